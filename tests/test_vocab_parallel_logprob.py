"""log pi(a_t) and the entropy fused with a vocabulary-parallel LM head (issue 54.1 on Megatron:
`verl_dppo.math.fused_logprob.vocab_parallel_token_logprobs`): each rank holds a shard of the weight's rows; against
a float64 log-softmax of the whole logits with gradients, float32 peaked rows (top-1 1 - 1e-9, the max tied across
ranks) and log-probs down to -100, bf16. Two CPU processes in a gloo group stand for two tensor-parallel ranks; one
rank is `fused_token_logprobs`; the kernels' path (a GPU's) under Triton's interpreter."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from reference import entropy_reference, llm_logits
from verl_dppo.math.fused_logprob import fused_token_logprobs
from verl_dppo.math.fused_logprob import _parallel, vocab_parallel_token_logprobs

TP = 2


def _case(rows, hidden, vocab, seed, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(rows, hidden, generator=gen, dtype=torch.float64).to(dtype)
    w = (torch.randn(vocab, hidden, generator=gen, dtype=torch.float64) * 0.5).to(dtype)
    return h, w, torch.randint(0, vocab, (rows,), generator=gen)


def _reference(logits, labels):
    log_p = torch.log_softmax(logits.double(), dim=-1)
    return log_p.gather(1, labels[:, None]).squeeze(1), -(log_p.exp() * log_p).sum(dim=-1)


def _weighted(log_p, entropy, seed):
    gen = torch.Generator().manual_seed(seed)
    ga, ge = (torch.randn(log_p.shape, generator=gen, dtype=torch.float64) for _ in range(2))
    return (log_p.double() * ga).sum() + (entropy.double() * ge).sum()


def _close(got, want, tol):
    got, want = got.detach().double(), want.detach().double()
    return float((got - want).abs().max()) <= tol * max(1.0, float(want.abs().max()))


def _check_float64(shard, rank, group, where):
    """shard(w) -> (this rank's rows, vocab_start); the whole-vocabulary float64 reference, with gradients."""
    h, w, labels = _case(23, 8, 50, seed=1)
    hr, wr = h.clone().requires_grad_(), w.clone().requires_grad_()
    ref_lp, ref_ent = _reference(hr @ wr.t() / 0.6, labels)
    want_lp, want_ent = ref_lp.detach(), ref_ent.detach()
    want_gh, want_gw = torch.autograd.grad(_weighted(ref_lp, ref_ent, 2), (hr, wr), retain_graph=True)
    w_local, start = shard(w)
    for chunk in (7, 64):
        hh, ww = h.clone().requires_grad_(), w_local.clone().requires_grad_()
        log_p, ent = _parallel(hh, ww, labels, start, 0.6, group, True, chunk, True)
        assert _close(log_p, want_lp, 1e-12) and _close(ent, want_ent, 1e-12), where
        gh, gw = torch.autograd.grad(_weighted(log_p, ent, 2), (hh, ww))
        assert _close(gh, want_gh, 1e-12), f"{where}: grad hidden"
        assert _close(gw, want_gw[start : start + w_local.shape[0]], 1e-12), f"{where}: grad weight shard"
    # log pi alone: the same values, the gradient without the entropy's term
    hh, ww = h.clone().requires_grad_(), w_local.clone().requires_grad_()
    lp_only, none = _parallel(hh, ww, labels, start, 0.6, group, False, 5, True)
    assert none is None and _close(lp_only, want_lp, 1e-12), where
    gh, _ = torch.autograd.grad((lp_only * 3.0).sum(), (hh, ww))
    (want_gh_lp,) = torch.autograd.grad((ref_lp * 3.0).sum(), hr)
    assert _close(gh, want_gh_lp, 1e-12), f"{where}: grad hidden (log pi only)"
    return h, w_local, labels, start, want_gh


def _check_peaked(shard, group, where, vocab=64):
    """W = I: the logits are the hidden states exactly. a_t the dominant token (log pi ~ -1e-9) on odd rows, ~100
    nats down on even ones; rows 0-3 have their max tied across the two halves of the vocabulary."""
    for top1 in (1 - 1e-9, 1 - 1e-3):
        logits = llm_logits(16, vocab, seed=3, top1_prob=top1)
        half = vocab // 2
        top = logits[:4].argmax(dim=1)
        logits[torch.arange(4), (top + half) % vocab] = logits[torch.arange(4), top]  # ties across the ranks
        logits = logits.float()
        labels = logits.argmax(dim=1)
        labels[::2] = logits[::2].argmin(dim=1)
        w_local, start = shard(torch.eye(vocab))
        log_p, ent = _parallel(logits, w_local, labels, start, 1.0, group, True, 5, True)
        want_lp, _ = _reference(logits, labels)
        assert float(want_lp.min()) < -90
        assert ((log_p.double() - want_lp).abs() <= 1e-6 * want_lp.abs().clamp(min=1.0)).all(), where
        want_ent = entropy_reference(logits.double())
        err = ((ent.double() - want_ent).abs() / want_ent).max()
        assert err <= 2e-6, f"{where} top1 {top1}: entropy relative error {float(err):.2e}"


def _check_bf16(shard, group, where):
    """bf16 hidden and weight: the unsharded pass's values to float32 rounding, gradients to bf16 rounding."""
    h, w, labels = _case(40, 32, 300, seed=4, dtype=torch.bfloat16)
    hh, wh = h.clone().requires_grad_(), w.clone().requires_grad_()
    want_lp, want_ent = fused_token_logprobs(hh, wh, labels, 0.7, entropy=True, chunk_tokens=16)
    gen = torch.Generator().manual_seed(5)
    ga, ge = torch.randn(40, generator=gen), torch.randn(40, generator=gen)
    want_gh, want_gw = torch.autograd.grad((want_lp * ga + want_ent * ge).sum(), (hh, wh))
    w_local, start = shard(w)
    hh, ww = h.clone().requires_grad_(), w_local.clone().requires_grad_()
    log_p, ent = _parallel(hh, ww, labels, start, 0.7, group, True, 16, True)
    assert log_p.dtype == ent.dtype == torch.float32
    assert _close(log_p, want_lp, 1e-5) and _close(ent, want_ent, 1e-5), where
    gh, gw = torch.autograd.grad((log_p * ga + ent * ge).sum(), (hh, ww))
    assert gh.dtype == gw.dtype == torch.bfloat16
    assert _close(gh, want_gh, 2e-2) and _close(gw, want_gw[start : start + w_local.shape[0]], 2e-2), where


def test_one_rank():
    """group None: the public function is `fused_token_logprobs` (the same tensors); the vocabulary-parallel
    arithmetic itself on one rank against the float64 reference, peaked rows and bf16."""
    h, w, labels = _case(17, 8, 30, seed=6)
    got = vocab_parallel_token_logprobs(h, w, labels, 0, 0.8, None, entropy=True, chunk_tokens=4)
    want = fused_token_logprobs(h, w, labels, 0.8, entropy=True, chunk_tokens=4)
    assert all(torch.equal(g, x) for g, x in zip(got, want))
    whole = lambda weight: (weight, 0)  # noqa: E731
    _check_float64(whole, 0, None, "one rank")
    _check_peaked(whole, None, "one rank")
    _check_bf16(whole, None, "one rank")
    with pytest.raises(ValueError, match="labels"):
        vocab_parallel_token_logprobs(h, w, labels[:5])
    with pytest.raises(ValueError, match="vocab_start"):
        vocab_parallel_token_logprobs(h, w, labels, 3)


def _rank(rank: int, init_file: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=TP)
    group = dist.group.WORLD

    def shard(weight):
        rows = weight.shape[0] // TP
        return weight[rank * rows : (rank + 1) * rows], rank * rows

    where = f"TP={TP} rank {rank}"
    h, w_local, labels, start, want_gh = _check_float64(shard, rank, group, where)
    # reduce_grad_hidden=False: this rank's share of dh; the group's sum is the whole gradient
    hh = h.clone().requires_grad_()
    log_p, ent = vocab_parallel_token_logprobs(
        hh, w_local, labels, start, 0.6, group, entropy=True, chunk_tokens=7, reduce_grad_hidden=False
    )
    (share,) = torch.autograd.grad(_weighted(log_p, ent, 2), hh)
    assert not _close(share, want_gh, 1e-3), f"{where}: one rank's share is not the whole gradient"
    dist.all_reduce(share)
    assert _close(share, want_gh, 1e-12), f"{where}: the shares' sum"
    _check_peaked(shard, group, where)
    _check_bf16(shard, group, where)
    dist.destroy_process_group()


def test_two_tensor_parallel_ranks():
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_rank, args=(os.path.join(tmp, "init"),), nprocs=TP, join=True)


KERNELS_CHILD = """
import verl_dppo.math.fused_logprob as fused
import test_vocab_parallel_logprob as tests

import torch

reads, original = [], fused.max_sum_outside_and_entropy_sums
fused.max_sum_outside_and_entropy_sums = lambda *args, **kwargs: reads.append(1) or original(*args, **kwargs)
torch_sums, torch_original = [], fused.entropy_sums
fused.entropy_sums = lambda block, *args: torch_sums.append(block.dtype) or torch_original(block, *args)
tests.test_one_rank()
assert reads, "the kernels' path did not run"
# the entropy's sums from the kernel's one read of each chunk: torch's second pass only where float64 keeps it
assert set(torch_sums) == {torch.float64}, torch_sums
tests.test_two_tensor_parallel_ranks()
print("kernels' path agrees")
"""


def test_the_kernels_path_under_tritons_interpreter():
    """The same checks with the chunks read by the Triton kernels (a GPU's path: bf16 read in place, the max, the sum
    outside a_t and the entropy's sums in one read, dL/dlogits by `scaled_exp_into`), run by Triton's interpreter in
    a child process
    (Triton from .venv/triton-interpret, as tests/test_kernels.py); float64 stays on the torch path."""
    site = Path(sys.prefix) / "triton-interpret"
    assert (site / "triton").is_dir(), f"{site} holds no Triton: `make venv` installs it there"
    env = dict(
        os.environ,
        TRITON_INTERPRET="1",
        VERL_DPPO_KERNELS="triton",
        PYTHONPATH=os.pathsep.join(
            [str(site), str(Path(__file__).resolve().parent), *filter(None, [os.environ.get("PYTHONPATH")])]
        ),
    )
    done = subprocess.run([sys.executable, "-c", KERNELS_CHILD], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "kernels' path agrees" in done.stdout, done.stdout[-3000:] + done.stderr[-6000:]
