"""The binary modes and the baselines on Megatron's fused LM head (patches/megatron_fused_head.py, issue 54.1): a step
of the engine marked by the plugin's loss takes the plugin's vocabulary-parallel pass where verl's fused forward calls
its Triton `linear_cross_entropy`; verl's own modes (`vanilla`), the Top-K modes and an engine without fused kernels
keep verl's kernel.

verl's kernel is Triton-only (CUDA), so it cannot run here: where a call must reach it, `LinearCrossEntropy.forward`
is replaced by a recorder. The routing test uses the plugin's two wrappers around stand-ins of verl's
`MegatronEngineWithLMHead.forward_step` (which takes the micro-batch from its iterator) and of the kernel. The two-rank
test runs verl's real `model_forward_fused._fused_GPTModel_forward` (the legacy path megatron-core 0.16.1 takes; and
`fused_output_processor`, the output-processor hook's, megatron-core >= 0.18) with
megatron-core's real parallel_state and sequence-parallel all-gather on a gloo group, around a stand-in model
(embedding and decoder replaced by the hidden states), with and without sequence parallelism: the outputs and the
gradients to the hidden states and to each rank's weight shard equal a float64 log-softmax of the whole logits.
"""

from __future__ import annotations

import functools
import os
import tempfile
import types

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import verl  # noqa: F401  (loads the plugin)
import verl.workers.utils.losses as verl_losses
from tensordict import TensorDict
from verl.utils import tensordict_utils as tu

from helpers import actor_config
from verl_dppo.math.fused_logprob import fused_token_logprobs
from verl_dppo.patches import megatron_fused_head
from verl_dppo.patches.fused_lm_head import worker_loss

PLUGIN_MODES = ("dppo_binary_tv", "dppo_binary_kl", "grpo_clip", "pg_is")
TP = 2


def _loss(mode: str, plain: bool = False):
    return functools.partial(verl_losses.ppo_loss, config=actor_config(mode, plain=plain))


def _batch(calculate_entropy: bool) -> TensorDict:
    batch = TensorDict({}, batch_size=[])
    tu.assign_non_tensor(batch, calculate_entropy=calculate_entropy)
    return batch


def _close(got, want, tol):
    got, want = got.detach().double(), want.detach().double()
    return float((got - want).abs().max()) <= tol * max(1.0, float(want.abs().max()))


def _inputs(seed=0, tokens=12, hidden=8, vocab=40):
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(tokens, 1, hidden, generator=gen, dtype=torch.float64)  # Megatron's [s, b, h]
    w = torch.randn(vocab, hidden, generator=gen, dtype=torch.float64) * 0.5
    return h, w, torch.randint(0, vocab, (1, tokens), generator=gen)  # labels [b, s], as verl packs them


def test_plugin_modes_take_the_plugin_pass_and_verls_keep_the_kernel():
    verl_calls = []

    def verl_kernel(hidden, weight, labels, temperature, reduction, group):
        verl_calls.append(reduction)
        return "verl", "verl"

    module = types.SimpleNamespace(linear_cross_entropy=verl_kernel)
    megatron_fused_head.patch_model_forward_fused(module)
    h, w, labels = _inputs()

    def engine_step(self, batch_iter, model, loss_fn, post):  # verl's forward_step: takes the batch, runs the model
        next(batch_iter)
        return module.linear_cross_entropy(h, w, labels, 0.7, "none", None)

    forward_step = megatron_fused_head._forward_step_wrapper(engine_step)
    fused = types.SimpleNamespace(engine_config=types.SimpleNamespace(use_fused_kernels=True))
    unfused = types.SimpleNamespace(engine_config=types.SimpleNamespace(use_fused_kernels=False))

    def step(engine, loss_fn, calculate_entropy=True):
        return forward_step(engine, iter([_batch(calculate_entropy)]), None, loss_fn, None)

    want_lp, want_ent = fused_token_logprobs(h.view(-1, 8), w, labels.view(-1), 0.7, entropy=True)
    for mode in PLUGIN_MODES:
        log_p, ent = step(fused, _loss(mode))
        assert log_p.dtype == ent.dtype == torch.float32 and log_p.shape == (12,), mode
        assert torch.equal(log_p, want_lp.float()) and torch.equal(ent, want_ent.float()), mode
        log_p, ent = step(fused, _loss(mode), calculate_entropy=False)
        assert torch.equal(log_p, want_lp.float()) and not ent.any(), mode
    assert not verl_calls
    # a no-grad pass (no loss function): the worker's loss says which mode
    with worker_loss(_loss("dppo_binary_tv")):
        assert torch.equal(step(fused, None)[0], want_lp.float())
    assert step(fused, None) == ("verl", "verl")
    for loss_fn in (_loss("vanilla", plain=True), _loss("dppo_topk_tv")):
        assert step(fused, loss_fn) == ("verl", "verl")
    assert step(unfused, _loss("dppo_binary_tv")) == ("verl", "verl")
    with worker_loss(_loss("vanilla", plain=True)):
        assert step(fused, None) == ("verl", "verl")
    assert verl_calls == ["none"] * 5
    assert megatron_fused_head._STEP.get() is None  # the mark ends with the step
    assert module.linear_cross_entropy(h, w, labels, 0.7, "none", None) == ("verl", "verl")


# ---- verl's real fused forward on two tensor-parallel ranks (gloo) ----


class _Model:
    """What `_fused_GPTModel_forward` reads of a GPTModel: the decoder's output is this rank's hidden states."""

    post_process = True

    def __init__(self, hidden, weight, sequence_parallel, hook=False):
        self.config = types.SimpleNamespace(sequence_parallel=sequence_parallel, moe_n_hash_layers=0)
        self.output_layer = types.SimpleNamespace(weight=weight)
        self._hidden, self.hook = hidden, hook

    def _preprocess(self, **_kwargs):
        return (None,) * 5

    def decoder(self, **_kwargs):
        return self._hidden


def _rank(rank: int, init_file: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=TP)
    import verl  # noqa: F401, F811  (the plugin: its patches)
    from megatron.core import parallel_state
    from verl.models.mcore import model_forward_fused as fused_module
    from verl.utils.kernel.linear_cross_entropy import LinearCrossEntropy

    assert fused_module.linear_cross_entropy.__wrapped__ is not None  # the plugin's patch is installed
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=TP)
    torch.cuda.current_device = lambda: "cpu"  # megatron-core's all-gather allocates on it (the CPU shim's piece 1)
    tp_group = parallel_state.get_tensor_model_parallel_group()
    verl_calls = []

    def recorder(ctx, hidden, weight, labels, temperature, reduction, group):
        verl_calls.append(group)
        n = labels.numel()
        return torch.zeros(n), torch.zeros(n)

    LinearCrossEntropy.forward = staticmethod(recorder)

    h, w, labels = _inputs(seed=3, tokens=12, vocab=40)
    rows = w.shape[0] // TP
    hr, wr = h.clone().requires_grad_(), w.clone().requires_grad_()
    log_soft = torch.log_softmax(hr.view(12, -1) @ wr.t() / 0.7, dim=-1)
    ref_lp = log_soft.gather(1, labels.view(-1, 1)).squeeze(1)
    ref_ent = -(log_soft.exp() * log_soft).sum(-1)
    gen = torch.Generator().manual_seed(4)
    ga, ge = torch.randn(12, generator=gen, dtype=torch.float64), torch.randn(12, generator=gen, dtype=torch.float64)
    want_gh, want_gw = torch.autograd.grad((ref_lp * ga + ref_ent * ge).sum(), (hr, wr))

    def engine_step(self, batch_iter, model, loss_fn, post):
        next(batch_iter)
        if model.hook:  # megatron-core >= 0.18's output-processor hook: verl's fused_output_processor
            return fused_module.fused_output_processor(
                hidden_states=model._hidden,
                output_layer=model.output_layer,
                output_weight=None,
                labels=labels,
                context=fused_module.FusedOutputProcessorContext(temperature=0.7),
                config=model.config,
            )
        return fused_module._fused_GPTModel_forward(model, None, None, None, labels=labels, temperature=0.7)

    forward_step = megatron_fused_head._forward_step_wrapper(engine_step)
    engine = types.SimpleNamespace(engine_config=types.SimpleNamespace(use_fused_kernels=True))
    for sequence_parallel, hook in ((False, False), (True, False), (False, True), (True, True)):
        where = f"rank {rank} sequence_parallel={sequence_parallel} output-processor hook={hook}"
        mine = slice(rank * 6, (rank + 1) * 6) if sequence_parallel else slice(None)
        local_h = h[mine].clone().requires_grad_()
        local_w = w[rank * rows : (rank + 1) * rows].clone().requires_grad_()
        out = forward_step(
            engine,
            iter([_batch(True)]),
            _Model(local_h, local_w, sequence_parallel, hook),
            _loss("dppo_binary_tv"),
            None,
        )
        # float32 out, as verl's kernel returns: float32 rounding of the float64 values and gradients
        assert out.log_probs.dtype == out.entropy.dtype == torch.float32 and out.log_probs.shape == (12,), where
        assert _close(out.log_probs, ref_lp, 1e-6) and _close(out.entropy, ref_ent, 1e-6), where
        gh, gw = torch.autograd.grad((out.log_probs * ga + out.entropy * ge).sum(), (local_h, local_w))
        assert _close(gh, want_gh[mine], 1e-6), f"{where}: grad hidden"
        assert _close(gw, want_gw[rank * rows : (rank + 1) * rows], 1e-6), f"{where}: grad weight shard"
        assert not verl_calls, where
    out = forward_step(
        engine,
        iter([_batch(True)]),
        _Model(h, w[rank * rows : (rank + 1) * rows], False),
        _loss("vanilla", plain=True),
        None,
    )
    assert verl_calls == [tp_group] and not out.log_probs.any()
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


def test_verls_fused_forward_on_two_tensor_parallel_ranks():
    pytest.importorskip("megatron.core")
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_rank, args=(os.path.join(tmp, "init"),), nprocs=TP, join=True)
