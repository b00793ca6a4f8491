"""Top-K DPPO on the actor side, through verl 0.9.1's real code: the FSDP engine's `prepare_model_inputs` -> a tiny
random `transformers` model -> `prepare_model_outputs` (its logits hook, both branches) -> verl's `ppo_loss`
(wrapped by the plugin) with `dppo_topk_tv` / `dppo_topk_kl`; checked against a float64 reference of Eq. (15)/(16)
and of the Eq. (12) mask."""

from __future__ import annotations

import functools
import math
import traceback

import pytest
import torch
from tensordict import TensorDict

import verl  # noqa: F401  (loads the plugin)
import verl.workers.utils.losses as verl_losses
from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY
from verl.utils import tensordict_utils as tu
from verl.workers.config import FSDPEngineConfig
from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

from helpers import actor_config
from test_topk_divergence import reference_topk

VOCAB, K, TEMPERATURE = 64, 4, 0.7


@pytest.fixture(scope="module")
def model():
    return tiny_llama()


def tiny_llama():
    """The random Llama every test here runs (bench/host_reads.py too)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    return LlamaForCausalLM(config).eval()


def engine() -> FSDPEngineWithLMHead:
    """verl's FSDP engine object without FSDP (no device, no process group): the two methods under test only read
    these attributes (what `FSDPEngine.__init__` sets for one rank without sequence parallelism)."""
    eng = object.__new__(FSDPEngineWithLMHead)
    eng.engine_config = FSDPEngineConfig()
    eng.pad_to_length, eng.pad_to_length_bucket = False, 0
    eng.use_ulysses_sp, eng.ulysses_sequence_parallel_size = False, 1
    return eng


def nested(rows):
    return torch.nested.as_nested_tensor(list(rows), layout=torch.jagged)


def micro_batch(prompt_lens, response_lens, seed=0, remove_padding=True, drop=()):
    """A v1 micro-batch: jagged fields as TransferQueue hands them over, with the rollout's top-K under a mu that
    is a perturbation of the model's own distribution (so some tokens are masked and some are not)."""
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, VOCAB, (p,), generator=gen) for p in prompt_lens]
    responses = [torch.randint(0, VOCAB, (r,), generator=gen) for r in response_lens]
    mu_logp = [
        torch.log_softmax(torch.randn(r, VOCAB, generator=gen, dtype=torch.float64) * 2, -1) for r in response_lens
    ]
    topk = [m.topk(K, dim=-1) for m in mu_logp]
    rollout_lp = [m.gather(1, resp[:, None]).squeeze(1).float() for m, resp in zip(mu_logp, responses)]
    masks = [torch.ones(r, dtype=torch.int64) for r in response_lens]
    fields = {
        "input_ids": nested([torch.cat([p, r]) for p, r in zip(prompts, responses)]),
        "position_ids": nested([torch.arange(p + r) for p, r in zip(prompt_lens, response_lens)]),
        "prompts": nested(prompts),
        "responses": nested(responses),
        "response_mask": nested(masks),
        "rollout_log_probs": nested(rollout_lp),
        "old_log_probs": nested(rollout_lp),
        "advantages": nested([torch.randn(r, generator=gen) for r in response_lens]),
        "rollout_topk_ids": nested([t.indices for t in topk]),
        "rollout_topk_logprobs": nested([t.values.float() for t in topk]),
    }
    for key in drop:
        fields.pop(key)
    data = TensorDict(fields, batch_size=[len(prompt_lens)])
    data["temperature"] = torch.full((len(prompt_lens),), TEMPERATURE)
    tu.assign_non_tensor(
        data,
        use_remove_padding=remove_padding,
        distillation_use_topk=True,
        dp_size=1,
        batch_num_tokens=None,
        global_batch_size=None,
    )
    return data, mu_logp


def run_engine(model, data, config):
    loss_fn = functools.partial(verl_losses.ppo_loss, config=config)  # what engine_workers builds
    eng = engine()
    inputs, output_args = eng.prepare_model_inputs(data)
    raw = model(**inputs, use_cache=False)
    model_output = eng.prepare_model_outputs(raw, output_args, data, logits_processor_func=loss_fn)
    return loss_fn, model_output


def reference_stats(model, data, mu_logp):
    """Eq. (15)/(16) per response token from the full softmax of the model's own logits (float64)."""
    tv, kl = [], []
    for i in range(data.batch_size[0]):
        ids = data["input_ids"][i]
        p = data["prompts"][i].numel()
        with torch.no_grad():
            logits = model(input_ids=ids[None], use_cache=False).logits[0].double() / TEMPERATURE
        pi = torch.softmax(logits, -1)
        row_tv, row_kl = [], []
        for t in range(data["responses"][i].numel()):
            a, b = reference_topk(mu_logp[i][t].exp().tolist(), pi[p - 1 + t].tolist(), K, int(ids[p + t]))
            row_tv.append(a)
            row_kl.append(b)
        tv.append(row_tv)
        kl.append(row_kl)
    return tv, kl


@pytest.mark.parametrize("remove_padding", [True, False], ids=["rmpad_branch", "padded_branch"])
def test_engine_logits_hook_matches_float64_reference(model, remove_padding):
    data, mu_logp = micro_batch([3, 5, 2], [4, 1, 6], remove_padding=remove_padding)
    _, model_output = run_engine(model, data, actor_config("dppo_topk_tv", topk=K))
    ref_tv, ref_kl = reference_stats(model, data, mu_logp)
    from verl.workers.utils.padding import no_padding_2_padding

    tv = no_padding_2_padding(model_output["dppo_topk_tv"], data)
    kl = no_padding_2_padding(model_output["dppo_topk_kl"], data)
    for i, row in enumerate(ref_tv):
        for t, value in enumerate(row):
            assert tv[i, t].item() == pytest.approx(value, rel=1e-4, abs=1e-6)
            assert kl[i, t].item() == pytest.approx(ref_kl[i][t], rel=1e-4, abs=1e-6)


@pytest.mark.parametrize("mode", ["dppo_topk_tv", "dppo_topk_kl"])
def test_loss_through_verl_ppo_loss_uses_topk_divergence_as_D(model, mode):
    delta = 0.05
    data, mu_logp = micro_batch([3, 4, 2, 5], [6, 5, 7, 3], seed=1)
    config = actor_config(mode, topk=K, delta_low=delta, delta_high=delta, ratio_cap=float("inf"))
    loss_fn, model_output = run_engine(model, data, config)
    offsets = model_output["log_probs"].offsets()
    leaf = model_output["log_probs"].values().detach().requires_grad_(True)
    model_output["log_probs"] = torch.nested.nested_tensor_from_jagged(leaf, offsets)
    loss, metrics = loss_fn(model_output=model_output, data=data, dp_group=None)
    loss.backward()

    ref_tv, ref_kl = reference_stats(model, data, mu_logp)
    reference_d = ref_tv if mode == "dppo_topk_tv" else ref_kl
    n_tokens, blocked, expected = 0, 0, []
    from verl.workers.utils.padding import no_padding_2_padding

    pi = no_padding_2_padding(model_output["log_probs"], data).detach()
    for i, row in enumerate(reference_d):
        for t, d in enumerate(row):
            adv = float(data["advantages"][i][t])
            log_ratio = float(pi[i, t]) - float(data["rollout_log_probs"][i][t])
            block = (adv > 0 and log_ratio > 0 and d > delta) or (adv < 0 and log_ratio < 0 and d > delta)
            blocked += block
            n_tokens += 1
            expected.append(0.0 if block else -math.exp(log_ratio) * adv)
    assert 0 < blocked < n_tokens, "the case must mask some tokens and keep others"
    clipfrac = metrics["actor/pg_clipfrac"]
    clipfrac = clipfrac.values[0] if hasattr(clipfrac, "values") else clipfrac
    assert clipfrac == pytest.approx(blocked / n_tokens)
    # token-mean: d loss / d log pi_t = coefficient / n_tokens, at the packed position that predicts token t
    grad = no_padding_2_padding(torch.nested.nested_tensor_from_jagged(leaf.grad, offsets), data)
    got = [grad[i, t].item() * n_tokens for i, row in enumerate(reference_d) for t in range(len(row))]
    assert got == pytest.approx(expected, rel=1e-4, abs=1e-6)


@pytest.mark.parametrize("mode", ["dppo_topk_tv", "troll"])
def test_the_rows_mass_is_in_the_log(model, mode):
    """actor/dppo/rollout_topk_mass_mean (troll: actor/troll/): the mean over response tokens of sum_k mu(v_k) of
    the rows the rollout sent, through verl's ppo_loss, so that a log shows the rows came through (issue 25)."""
    data, mu_logp = micro_batch([3, 4, 2], [6, 5, 7], seed=2)
    loss_fn, model_output = run_engine(model, data, actor_config(mode, topk=K))
    _, metrics = loss_fn(model_output=model_output, data=data, dp_group=None)
    prefix = "actor/troll/" if mode == "troll" else "actor/dppo/"
    metric = metrics[f"{prefix}rollout_topk_mass_mean"]
    got = metric.values[0] if hasattr(metric, "values") else metric
    expected = torch.cat([m.exp().topk(K, dim=-1).values.sum(-1) for m in mu_logp]).mean().item()
    assert 0.0 < expected < 0.99  # a spread mu: the rows hold part of the mass, and that part is what is logged
    assert got == pytest.approx(expected, rel=1e-5)


def test_registered_by_import_verl():
    assert {"dppo_topk_tv", "dppo_topk_kl"} <= set(POLICY_LOSS_REGISTRY)


def test_missing_topk_fields_name_the_setting(model):
    data, _ = micro_batch([3], [4], drop=("rollout_topk_ids", "rollout_topk_logprobs"))
    with pytest.raises(ValueError, match="calculate_log_probs=True"):
        run_engine(model, data, actor_config("dppo_topk_kl", topk=K))


def test_k_mismatch_between_batch_and_config_is_refused(model):
    data, _ = micro_batch([3], [4])
    with pytest.raises(ValueError, match="policy_loss.topk=5"):
        run_engine(model, data, actor_config("dppo_topk_kl", topk=5))


def test_recompute_anchor_is_a_clear_error(model):
    data, _ = micro_batch([3], [4])
    config = actor_config("dppo_topk_tv", topk=K, anchor="recompute")
    loss_fn, model_output = run_engine(model, data, config)
    with pytest.raises(ValueError, match="no top-K of a recomputed policy"):
        loss_fn(model_output=model_output, data=data, dp_group=None)


def test_loss_without_the_hook_refuses_instead_of_guessing(model):
    data, _ = micro_batch([3], [4])
    config = actor_config("dppo_topk_tv", topk=K)
    loss_fn, model_output = run_engine(model, data, config)
    for key in ("dppo_topk_tv", "dppo_topk_kl"):
        model_output.pop(key)  # as if the engine's hook had not run
    with pytest.raises(ValueError, match="the loss was not called through verl's engine with the hook on"):
        loss_fn(model_output=model_output, data=data, dp_group=None)


def test_train_batch_turns_the_hook_on_and_refuses_the_triton_fused_backend():
    from verl.workers.engine_workers import TrainingWorker

    from verl_dppo.patches.engine_workers import prepare_train_batch

    assert getattr(TrainingWorker.train_batch, "__verl_dppo_patched__", False)
    worker = object.__new__(TrainingWorker)
    worker.loss_fn = functools.partial(verl_losses.ppo_loss, config=actor_config("dppo_topk_tv", topk=K))
    worker.engine_config = FSDPEngineConfig()
    data, _ = micro_batch([3], [4])
    tu.assign_non_tensor(data, distillation_use_topk=False)  # what the v1 trainer sends
    prepare_train_batch(worker, data)
    assert tu.get_non_tensor_data(data, "distillation_use_topk", False) is True
    worker.engine_config = FSDPEngineConfig(use_fused_kernels=True)  # torch backend: fused with the LM head
    prepare_train_batch(worker, data)
    from types import SimpleNamespace

    worker.model_config = SimpleNamespace(fused_kernel_options={"impl_backend": "triton"})
    with pytest.raises(ValueError, match="impl_backend=torch"):
        prepare_train_batch(worker, data)
    worker.engine_config = FSDPEngineConfig()
    bare, _ = micro_batch([3], [4], drop=("rollout_topk_ids",))
    with pytest.raises(ValueError, match="rollout_topk_ids"):
        prepare_train_batch(worker, bare)
    # another loss mode: untouched
    worker.loss_fn = functools.partial(verl_losses.ppo_loss, config=actor_config("dppo_binary_tv"))
    tu.assign_non_tensor(bare, distillation_use_topk=False)
    prepare_train_batch(worker, bare)
    assert tu.get_non_tensor_data(bare, "distillation_use_topk", False) is False


def _poke(data, key, seq, t, value, column=None):
    """Set one token's rollout statistic inside a jagged field."""
    rows = list(data[key].unbind())
    row = rows[seq].clone()
    if column is None:
        row[t] = value
    else:
        row[t, column] = value
    rows[seq] = row
    data[key] = nested(rows)


@pytest.mark.parametrize("mode", ["dppo_topk_tv", "dppo_topk_kl"])
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_nonfinite_rollout_statistics_drop_the_token_like_every_mode(model, mode, bad):
    # Issue 8.5 / docs/bad-input.md: a NaN/inf rollout log-prob drops the token and counts it in dropped_frac;
    # the Top-K modes did raise TopKInputError in the engine hook instead. A NaN / +inf top-K entry is unusable too.
    data, _ = micro_batch([3, 4], [5, 6], seed=2)
    _poke(data, "rollout_log_probs", 0, 1, bad)
    _poke(data, "rollout_topk_logprobs", 1, 2, math.nan if math.isnan(bad) else abs(bad), column=0)
    config = actor_config(mode, topk=K, delta_low=0.05, delta_high=0.05, ratio_cap=10.0)
    loss_fn, model_output = run_engine(model, data, config)
    offsets = model_output["log_probs"].offsets()
    leaf = model_output["log_probs"].values().detach().requires_grad_(True)
    model_output["log_probs"] = torch.nested.nested_tensor_from_jagged(leaf, offsets)
    loss, metrics = loss_fn(model_output=model_output, data=data, dp_group=None)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(leaf.grad).all()
    assert metrics["actor/dppo/dropped_frac"].aggregate() == pytest.approx(2 / 11)
    # the two dropped tokens get no gradient (positions prompt_len - 1 + t in the packed stream)
    assert leaf.grad[3 - 1 + 1] == 0.0 and leaf.grad[8 + 4 - 1 + 2] == 0.0


HOST_READS = ("tolist", "item", "__bool__", "__int__", "__float__", "__index__")


def _count_host_reads(monkeypatch) -> list:
    """Each call of a tensor method that reads a value back to the host (a wait for the device on a GPU), with the file
    it was called from."""
    calls = []
    for name in HOST_READS:
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _original=original, _name=name, **kwargs):
            calls.append((_name, traceback.extract_stack(limit=2)[0].filename))
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    return calls


def _dense(data):
    """The micro-batch in verl's padded layout (prompts left-padded, responses right-padded, an attention mask): the
    other branch of verl's no_padding_2_padding."""
    prompts = torch.nested.to_padded_tensor(data["prompts"], 0)
    prompt_lens = data["prompts"].offsets().diff()
    width = prompts.shape[1]
    left = torch.stack([torch.roll(row, int(width - n)) for row, n in zip(prompts, prompt_lens)])
    responses = torch.nested.to_padded_tensor(data["responses"], 0)
    mask = torch.cat(
        [
            torch.arange(width)[None] >= (width - prompt_lens)[:, None],
            torch.arange(responses.shape[1])[None] < data["responses"].offsets().diff()[:, None],
        ],
        dim=1,
    ).long()
    return TensorDict({"prompts": left, "responses": responses, "attention_mask": mask}, batch_size=[prompts.shape[0]])


@pytest.mark.parametrize("layout", ["nested", "nested_with_max_response_len", "padded"])
def test_the_wrapper_pads_its_fields_as_verl_does_with_one_host_read(layout, monkeypatch):
    """Issue 75: the `ppo_loss` wrapper pads the entropy, the Top-K statistics, TROLL's nine terms and the rollout's
    top-K mass from one layout of the micro-batch (`_Padding`): the values, the shapes and the gradients equal verl's
    `no_padding_2_padding` field by field (nested and padded layouts, 1-D and 2-D fields), and the whole extraction
    reads the host once, where verl's function reads it 3 + 2B times a field for B sequences."""
    from verl.workers.utils.padding import no_padding_2_padding

    from verl_dppo.patches.workers_utils_losses import _extract, _Padding
    from verl_dppo.plugin import troll_mode
    from verl_dppo.plugin.topk_mode import OUTPUT_KEYS

    for prompt_lens, response_lens in (([3, 5, 2], [4, 1, 6]), ([2, 7, 1, 4, 3, 5, 2, 6], [5, 2, 7, 1, 3, 6, 4, 2])):
        data, _ = micro_batch(prompt_lens, response_lens, seed=len(prompt_lens))
        if layout == "nested_with_max_response_len":
            tu.assign_non_tensor(data, max_response_len=9)
        frame = _dense(data) if layout == "padded" else data
        nnz = sum(prompt_lens) + sum(response_lens)
        gen = torch.Generator().manual_seed(1)
        for shape in ((nnz,), (nnz, 3)):
            values = torch.randn(*shape, generator=gen, dtype=torch.float64).requires_grad_()
            ours, theirs = _Padding(frame)(values), no_padding_2_padding(values, frame)
            assert ours.shape == theirs.shape and torch.equal(ours, theirs), (layout, shape)
            weights = torch.randn(theirs.shape, generator=gen, dtype=torch.float64)
            (grad_ours,) = torch.autograd.grad((ours * weights).sum(), values)
            (grad_theirs,) = torch.autograd.grad((theirs * weights).sum(), values)
            assert torch.equal(grad_ours, grad_theirs), (layout, shape)
        if layout == "padded":
            continue
        keys = ("entropy", *OUTPUT_KEYS.values(), *troll_mode.OUTPUT_KEYS.values())
        model_output = {key: torch.randn(nnz, generator=gen) for key in keys}
        calls = _count_host_reads(monkeypatch)
        extras = _extract(model_output, data)
        monkeypatch.undo()
        assert len(calls) == 1, (len(prompt_lens), calls)
        assert torch.equal(extras.entropy, no_padding_2_padding(model_output["entropy"], data))
        assert torch.equal(extras.troll["log_p"], no_padding_2_padding(model_output["troll_log_p"], data))
        rows = data["rollout_topk_logprobs"]
        mass = torch.nn.utils.rnn.pad_sequence(
            list(rows.values().float().exp().sum(-1).split(rows.offsets().diff().tolist())), batch_first=True
        )
        assert torch.equal(extras.topk_mass, mass)


def test_the_top_k_fields_are_laid_out_with_one_host_read(monkeypatch):
    """Issue 75: the logits hook lays the rollout's top-K rows out on the packed stream with one read of the lengths
    and checks (three before, one of which compared the packed length with itself), and a packed stream that is not
    the prompts and responses end to end is refused."""
    from verl_dppo.patches.topk_fields import packed_rollout_fields

    data, _ = micro_batch([3, 5, 2, 4], [4, 1, 6, 2])
    calls = _count_host_reads(monkeypatch)
    fields = packed_rollout_fields("dppo_topk_tv", K, data, torch.device("cpu"))
    monkeypatch.undo()
    assert [name for name, _ in calls] == ["tolist"], calls
    assert fields[-1].shape == (3 + 5 + 2 + 4 + 4 + 1 + 6 + 2,) and int(fields[-1].sum()) == 4 + 1 + 6 + 2
    data["input_ids"] = nested([ids[:-1] for ids in data["input_ids"].unbind()])
    with pytest.raises(ValueError, match="packed length 23 != the prompts' and responses' 27 tokens"):
        packed_rollout_fields("dppo_topk_tv", K, data, torch.device("cpu"))


@pytest.mark.parametrize("mode", ["dppo_topk_tv", "troll"])
def test_the_loss_reads_the_host_three_times_whatever_the_mode(model, mode, monkeypatch):
    """Issue 75: in verl's `ppo_loss` through the plugin's wrapper, the plugin's own code reads the host three times a
    micro-batch: the padding's layout, the loss's finiteness probe and its one transfer of every diagnostic (the
    family's own and the rollout's top-K mass among them, which had a read each before)."""
    data, _ = micro_batch([3, 5, 2, 4], [4, 1, 6, 2])
    loss_fn, model_output = run_engine(model, data, actor_config(mode, topk=K))
    loss_fn(model_output=model_output, data=data)  # the first call's announcements
    calls = _count_host_reads(monkeypatch)
    _, metrics = loss_fn(model_output=model_output, data=data)
    monkeypatch.undo()
    assert any(name.endswith("rollout_topk_mass_mean") for name in metrics), sorted(metrics)
    plugin = [(name, where) for name, where in calls if "/verl_dppo/" in where or "/patches/" in where]
    assert len(plugin) == 3, plugin
