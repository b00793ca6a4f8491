"""Top-K DPPO and TROLL under verl's `use_fused_kernels=True` (issue 20), through verl 0.9.1's real FSDP engine code:
`FSDPEngineWithLMHead.forward_step` -> `prepare_model_inputs` -> a tiny random Llama whose forward verl patched for
fused kernels (`patch_forward_with_backends`, torch backend: `FusedLinearForPPO`) -> `prepare_model_outputs` ->
verl's `ppo_loss` (wrapped by the plugin). The same micro-batch through the unfused engine (logits and the logits
hook) is the reference: the loss receives the same outputs (the Top-K statistics or TROLL's terms, log pi(a_t), the
entropy), the loss and the parameters' gradients agree, and the fused step never builds the logits.

Also: the settings under which the fused pass cannot serve (Triton backend, Megatron, padded inputs) are refused
with the key to change, and the two logits hooks no longer import each other.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import types
from pathlib import Path

import pytest
import torch
from tensordict import TensorDict

import verl  # noqa: F401  (loads the plugin)
import verl.utils.torch_functional as verl_F
import verl.workers.utils.losses as verl_losses
from verl.utils import tensordict_utils as tu
from verl.workers.config import FSDPEngineConfig
from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

from helpers import actor_config

VOCAB, K, TEMPERATURE = 96, 4, 0.7
REPO = Path(__file__).resolve().parent.parent


def _models():
    from transformers import LlamaConfig, LlamaForCausalLM

    from verl.models.transformers.monkey_patch import patch_forward_with_backends

    class FusedLlama(LlamaForCausalLM):  # its own class: verl's patch replaces the class's forward
        pass

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    plain = LlamaForCausalLM(config)
    fused = FusedLlama(config)
    fused.load_state_dict(plain.state_dict())
    patch_forward_with_backends(fused, use_fused_kernels=True, fused_kernels_backend="torch")
    return plain, fused


def _engine(module) -> FSDPEngineWithLMHead:
    """verl's FSDP engine object around `module` without FSDP (one rank, no sequence parallelism, float32: no
    autocast): the attributes forward_step and its callees read."""
    eng = object.__new__(FSDPEngineWithLMHead)
    eng.engine_config = FSDPEngineConfig()
    eng.pad_to_length, eng.pad_to_length_bucket = False, 0
    eng.use_ulysses_sp, eng.ulysses_sequence_parallel_size, eng.ulysses_device_mesh = False, 1, None
    eng._autocast_dtype = torch.float32
    eng.compute_entropy_from_logits = verl_F.entropy_from_logits  # FSDPEngine.__init__'s choice without compile
    eng.module = module
    return eng


def nested(rows):
    return torch.nested.as_nested_tensor(list(rows), layout=torch.jagged)


def micro_batch(fused: bool, prompt_lens=(3, 5, 2, 4), response_lens=(6, 2, 7, 5), seed=0, topk_hook=True):
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, VOCAB, (p,), generator=gen) for p in prompt_lens]
    responses = [torch.randint(0, VOCAB, (r,), generator=gen) for r in response_lens]
    mu_logp = [
        torch.log_softmax(torch.randn(r, VOCAB, generator=gen, dtype=torch.float64) * 2, -1) for r in response_lens
    ]
    topk = [m.topk(K, dim=-1) for m in mu_logp]
    responses[0][:3] = topk[0].indices[:3, 1]  # a_t inside mu's top-K on some tokens
    rollout_lp = [m.gather(1, resp[:, None]).squeeze(1).float() for m, resp in zip(mu_logp, responses)]
    data = TensorDict(
        {
            "input_ids": nested([torch.cat([p, r]) for p, r in zip(prompts, responses)]),
            "position_ids": nested([torch.arange(p + r) for p, r in zip(prompt_lens, response_lens)]),
            "prompts": nested(prompts),
            "responses": nested(responses),
            "response_mask": nested([torch.ones(r, dtype=torch.int64) for r in response_lens]),
            "rollout_log_probs": nested(rollout_lp),
            "old_log_probs": nested(rollout_lp),
            "advantages": nested([torch.randn(r, generator=gen) for r in response_lens]),
            "rollout_topk_ids": nested([t.indices for t in topk]),
            "rollout_topk_logprobs": nested([t.values.float() for t in topk]),
        },
        batch_size=[len(prompt_lens)],
    )
    tu.assign_non_tensor(
        data,
        temperature=TEMPERATURE,
        use_remove_padding=True,
        distillation_use_topk=topk_hook,
        use_fused_kernels=fused,
        calculate_entropy=True,
        dp_size=1,
        batch_num_tokens=None,
        global_batch_size=None,
    )
    return data


def step(module, mode: str, fused: bool, engine_options=None, **data_options):
    """One forward_step and backward: (loss, model_output, {parameter: gradient}); engine_options: FSDPEngineConfig
    fields to set, data_options: the micro-batch's non-tensor keys to set."""
    module.zero_grad(set_to_none=True)
    topk = mode.startswith("dppo_topk_") or mode == "troll"
    config = actor_config(mode, topk=K if topk else None, delta_low=0.05, delta_high=0.05)
    if not topk:  # the entropy's gradient reaches the parameters too
        config = dataclasses.replace(config, entropy_coeff=0.05)
    loss_fn = functools.partial(verl_losses.ppo_loss, config=config)  # what engine_workers builds
    engine = _engine(module)
    if engine_options:
        engine.engine_config = FSDPEngineConfig(**engine_options)
        if engine.engine_config.entropy_from_logits_with_chunking:  # FSDPEngine.__init__'s choice
            engine.compute_entropy_from_logits = verl_F.entropy_from_logits_with_chunking
    data = micro_batch(fused, topk_hook=topk)
    tu.assign_non_tensor(data, **data_options)
    loss, output = engine.forward_step(data, loss_function=loss_fn, forward_only=False)
    loss.backward()
    return float(loss), output["model_output"], {n: p.grad.clone() for n, p in module.named_parameters()}


@pytest.fixture(scope="module")
def models():
    return _models()


def _values(t):
    return t.values() if t.is_nested else t


@pytest.mark.parametrize("mode", ["dppo_topk_tv", "dppo_topk_kl", "troll"])
def test_fused_step_hands_the_loss_what_the_logits_hook_does(models, mode):
    plain, fused = models
    loss_ref, out_ref, grads_ref = step(plain, mode, fused=False)
    loss, out, grads = step(fused, mode, fused=True)
    assert set(out) == set(out_ref), set(out) ^ set(out_ref)
    hook_keys = [k for k in out if k.startswith(("dppo_topk_", "troll_"))]
    assert len(hook_keys) >= 2
    for key in ["log_probs", "entropy", *hook_keys]:
        assert torch.allclose(_values(out[key]).double(), _values(out_ref[key]).double(), rtol=1e-5, atol=1e-6), key
    assert loss == pytest.approx(loss_ref, rel=1e-5, abs=1e-7) and loss != 0.0
    for name, g in grads_ref.items():
        scale = max(1e-3, float(g.abs().max()))
        assert float((grads[name] - g).abs().max()) <= 1e-5 * scale, name
    if mode != "troll":
        assert 0 < float(_values(out["dppo_topk_tv"]).gt(0.05).float().mean()) < 1  # some tokens masked


def _verl_unfused(monkeypatch):
    """verl's own log-prob and entropy path on an unfused step, whatever the loss mode."""
    from verl_dppo.patches import fused_lm_head

    monkeypatch.setattr(fused_lm_head, "_unfused_config", lambda *args: None)


def _counted(monkeypatch, module, name):
    calls, real = [], getattr(module, name)
    monkeypatch.setattr(module, name, lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


def _agree(got, want):
    (loss, out, grads), (loss_ref, out_ref, grads_ref) = got, want
    for key in ("log_probs", "entropy"):
        if key in out_ref:
            assert torch.allclose(_values(out[key]).double(), _values(out_ref[key]).double(), rtol=1e-5, atol=1e-6), key
    assert loss == pytest.approx(loss_ref, rel=1e-5, abs=1e-7) and loss != 0.0
    for name, g in grads_ref.items():
        scale = max(1e-3, float(g.abs().max()))
        assert float((grads[name] - g).abs().max()) <= 1e-5 * scale, name


@pytest.mark.parametrize("mode", ["dppo_binary_tv", "dppo_binary_kl", "grpo_clip", "pg_is"])
def test_every_other_plugin_mode_takes_log_probs_and_entropy_from_the_plugins_one_read_head(models, mode, monkeypatch):
    """Issue 54.1: the binary modes and the ratio-clip / PG-IS baselines get log pi(a_t) and the entropy from the
    plugin's one-read passes instead of verl's: under use_fused_kernels from `verl_dppo.math.fused_logprob` (one
    read of each chunk's logits; verl's FusedLinearForPPO not called), without fused kernels from
    `verl_dppo.math.logits_logprob` (one read of the logits for both, instead of verl's entropy_from_logits and
    logprobs_from_logits). Either way the loss receives what verl's own unfused path computes, and the loss and
    every parameter's gradient agree. A loss mode of verl's own keeps verl's kernel and verl's unfused path."""
    from verl_dppo.math import fused_logprob, logits_logprob

    plain, fused = models
    ours = _counted(monkeypatch, fused_logprob, "fused_token_logprobs")
    unfused = _counted(monkeypatch, logits_logprob, "logits_logprobs")
    with monkeypatch.context() as verl_path:
        _verl_unfused(verl_path)
        reference = step(plain, mode, fused=False)
    assert unfused == []
    _agree(step(fused, mode, fused=True), reference)
    assert ours == [1] and unfused == [], "the plugin's fused pass did not serve the step"
    _agree(step(plain, mode, fused=False), reference)
    assert unfused == [1], "the plugin's pass on the logits did not serve the step (once for both)"
    ours.clear(), unfused.clear()  # verl's own PPO loss: verl's kernel and verl's path, the plugin's passes untouched
    loss_fn = functools.partial(verl_losses.ppo_loss, config=actor_config("vanilla", plain=True))
    for module, on in ((fused, True), (plain, False)):
        _engine(module).forward_step(micro_batch(on, topk_hook=False), loss_function=loss_fn, forward_only=False)
    assert ours == [] and unfused == []


@pytest.mark.parametrize("mode", ["dppo_topk_tv", "troll"])
def test_the_topk_modes_and_troll_take_log_probs_and_entropy_from_the_plugins_pass_unfused(models, mode, monkeypatch):
    """Issue 53.5: without fused kernels the Top-K modes and troll also take log pi(a_t) and the entropy from the
    plugin's one-read pass (verl's bf16 row loop made their steps 6.6x and 4.3x the binary step's on an H200), their
    logits hook beside it: the hook's outputs, log pi, the entropy, the loss and every gradient as on verl's path."""
    from verl_dppo.math import logits_logprob

    plain, _ = models
    unfused = _counted(monkeypatch, logits_logprob, "logits_logprobs")
    with monkeypatch.context() as verl_path:
        _verl_unfused(verl_path)
        reference = step(plain, mode, fused=False)
    assert unfused == []
    got = step(plain, mode, fused=False)
    assert unfused == [1], "the plugin's pass on the logits did not serve the step (once for both)"
    hook_keys = [k for k in reference[1] if k.startswith(("dppo_topk_", "troll_"))]
    assert len(hook_keys) >= 2 and set(got[1]) == set(reference[1])
    for key in hook_keys:
        assert torch.allclose(
            _values(got[1][key]).double(), _values(reference[1][key]).double(), rtol=1e-5, atol=1e-6
        ), key
    _agree(got, reference)


def test_verls_no_grad_pass_takes_the_plugins_pass_by_the_workers_loss(models, monkeypatch):
    """verl's old log-prob recompute calls forward_step without a loss function (compute_loss=False): inside the
    worker's infer_batch (wrapped by patches.engine_workers) the step is marked by the worker's loss, and log pi
    equals verl's path; a worker without a plugin loss (the reference model's: none) keeps verl's path."""
    from verl.workers.engine_workers import TrainingWorker

    from verl_dppo.math import logits_logprob
    from verl_dppo.patches import engine_workers

    plain, _ = models
    unfused = _counted(monkeypatch, logits_logprob, "logits_logprobs")

    def no_grad_step(_worker, data):  # what verl's infer_batch runs per micro-batch
        with torch.no_grad():
            return _engine(plain).forward_step(data, loss_function=None, forward_only=True)[1]["model_output"]

    def data():
        batch = micro_batch(False, topk_hook=False)
        tu.assign_non_tensor(batch, calculate_entropy=False)
        return batch

    reference = no_grad_step(None, data())
    assert unfused == []
    infer = engine_workers.make_infer_batch(no_grad_step)
    loss_fn = functools.partial(verl_losses.ppo_loss, config=actor_config("dppo_binary_tv"))
    got = infer(types.SimpleNamespace(loss_fn=loss_fn), data())
    assert unfused == [1]
    assert torch.allclose(
        _values(got["log_probs"]).double(), _values(reference["log_probs"]).double(), rtol=1e-5, atol=1e-6
    )
    unfused.clear()
    infer(types.SimpleNamespace(loss_fn=None), data())
    assert unfused == []
    assert getattr(TrainingWorker.infer_batch, "__verl_dppo_patched__", False)


@pytest.mark.parametrize(
    "options, passes",
    [
        ({"engine_options": {"entropy_from_logits_with_chunking": True, "entropy_from_logits_chunk_size": 5}}, 1),
        ({"engine_options": {"entropy_checkpointing": True}}, 3),  # entropy, log pi; the entropy again in the backward
        ({"calculate_entropy": False}, 1),
        ({"use_remove_padding": False}, 2),  # verl's padded branch: the entropy of [bsz, seqlen, V], log pi of the rows
    ],
)
@pytest.mark.parametrize("mode", ["dppo_binary_tv", "dppo_topk_tv"])
def test_the_unfused_plugin_pass_follows_verls_settings(models, options, passes, mode, monkeypatch):
    """dppo_binary_tv (and dppo_topk_tv, its logits hook beside the pass) without fused kernels under verl's other
    settings: the same outputs, loss and gradients as verl's own path, from the plugin's passes."""
    from verl_dppo.math import logits_logprob

    plain, _ = models
    unfused = _counted(monkeypatch, logits_logprob, "logits_logprobs")
    with monkeypatch.context() as verl_path:
        _verl_unfused(verl_path)
        reference = step(plain, mode, fused=False, **options)
    assert unfused == []
    got = step(plain, mode, fused=False, **options)
    assert ("entropy" in got[1]) == ("entropy" in reference[1])
    _agree(got, reference)
    assert len(unfused) == passes


def test_fused_step_never_builds_the_logits(models, monkeypatch):
    """The fused model's forward returns no logits, and the only [*, V] products are the fused pass's chunks."""
    _, fused = models
    seen = []
    original = FSDPEngineWithLMHead.prepare_model_outputs

    def spy(self, output, *args, **kwargs):
        seen.append(getattr(output, "logits", None))
        return original(self, output, *args, **kwargs)

    monkeypatch.setattr(FSDPEngineWithLMHead, "prepare_model_outputs", spy)
    step(fused, "dppo_topk_tv", fused=True)
    assert seen == [None]


def test_prepare_train_batch_accepts_the_torch_backend_and_refuses_what_it_cannot_serve():
    from types import SimpleNamespace

    from verl.workers.engine_workers import TrainingWorker

    from verl_dppo.patches.engine_workers import prepare_train_batch

    worker = object.__new__(TrainingWorker)
    worker.loss_fn = functools.partial(verl_losses.ppo_loss, config=actor_config("dppo_topk_tv", topk=K))
    worker.engine_config = FSDPEngineConfig(use_fused_kernels=True)
    worker.engine_config.use_remove_padding = True
    worker.model_config = SimpleNamespace(fused_kernel_options={"impl_backend": "torch"})
    data = micro_batch(fused=True)
    tu.assign_non_tensor(data, distillation_use_topk=False)
    prepare_train_batch(worker, data)
    assert tu.get_non_tensor_data(data, "distillation_use_topk", False) is True
    worker.model_config = SimpleNamespace(fused_kernel_options={"impl_backend": "triton"})
    with pytest.raises(ValueError, match="impl_backend=torch"):
        prepare_train_batch(worker, data)
    worker.model_config = SimpleNamespace(fused_kernel_options={"impl_backend": "torch"})
    worker.engine_config.use_remove_padding = False
    with pytest.raises(ValueError, match="use_remove_padding=True"):
        prepare_train_batch(worker, data)


def test_logits_hooks_do_not_import_each_other():
    """megatron_logits_hook takes the rollout's fields from topk_fields, not from fsdp_logits_hook (which imports
    the Megatron hook, lazily, for Megatron's calls): no import cycle."""

    def imported(name):
        tree = ast.parse((REPO / "patches" / f"{name}.py").read_text())
        return {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}

    assert "verl_dppo.patches.fsdp_logits_hook" not in imported("megatron_logits_hook")
    assert "verl_dppo.patches.fsdp_logits_hook" not in imported("topk_fields")
    assert "verl_dppo.patches.megatron_logits_hook" not in imported("topk_fields")
