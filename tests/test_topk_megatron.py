"""Top-K DPPO on Megatron's vocabulary-parallel logits, without Megatron: two CPU processes in a gloo group, each
holding half of the vocabulary, stand for two tensor-parallel ranks.

1. `vocab_parallel_topk_divergence` (all-reduced max / sum of exp outside A'_t, owner-only gather) equals the
   unsharded `topk_divergence` on the same logits, row for row (Eq. 15/16 reduction shared by both), and a float64
   reference on rows as peaked as a real LLM's (top-1 probability up to 1 - 1e-9).
2. The engine's hook (verl's wrapped `ppo_loss(student_logits=..., data=..., data_format=...)`, as
   `MegatronEngineWithLMHead._lm_head_logits_processor` calls it) lays the rollout's fields out like verl's own
   `preprocess_thd_engine` / `preprocess_bshd_engine` lay out the input ids: its output, gathered back with
   `postprocess_*_engine` and read by `no_padding_2_padding`, matches a float64 brute-force reference per response
   token. `megatron.core` is replaced by a few functions (TP rank/size/group, CP size 1) and a PackedSeqParams
   record: verl's real `verl.models.mcore.util` runs on them.
"""

from __future__ import annotations

import functools
import math
import os
import sys
import tempfile
import types

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

VOCAB, K, TP = 64, 4, 2


def _spawn(target, *args) -> None:
    """Run `target(rank, init_file, *args)` on TP gloo ranks; a failure on any rank fails the test."""
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(target, args=(os.path.join(tmp, "init"), *args), nprocs=TP, join=True)


def _init(rank: int, init_file: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=TP)


def _random_rows(seed: int, rows: int, dtype: torch.dtype):
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(rows, VOCAB, generator=gen) * 3).to(dtype)
    mu_logp = torch.log_softmax(logits.double() + torch.randn(rows, VOCAB, generator=gen, dtype=torch.float64), -1)
    topk_lp, topk_ids = mu_logp.topk(K, dim=-1)
    sampled = torch.randint(0, VOCAB, (rows,), generator=gen)
    sampled[::3] = topk_ids[::3, 1]  # some a_t inside the top-K, most outside; ids on both halves of the vocabulary
    sampled_lp = mu_logp.gather(1, sampled[:, None]).squeeze(1)
    mask = torch.rand(rows, generator=gen) > 0.25
    return logits, topk_ids, topk_lp.float(), sampled, sampled_lp.float(), mask


def _math_rank(rank: int, init_file: str) -> None:
    from verl_dppo.math.topk import TopKInputError, topk_divergence, vocab_parallel_topk_divergence

    _init(rank, init_file)
    half = VOCAB // TP
    # float64 logits: agreement to rounding of the reduction itself; float32/bf16: log Z summed in two halves
    # rounds differently from one logsumexp (a few 1e-7 in log pi).
    cases = ((torch.float64, 300, 1e-10), (torch.float32, 2**20, 1e-4), (torch.bfloat16, 1, 1e-4))
    for dtype, chunk_bytes, tol in cases:
        logits, ids, lp, sampled, sampled_lp, mask = _random_rows(seed=7, rows=37, dtype=dtype)
        shard = logits[:, rank * half : (rank + 1) * half]
        for row_mask in (None, mask):
            got = vocab_parallel_topk_divergence(
                shard, rank * half, VOCAB, None, ids, lp, sampled, sampled_lp, mask=row_mask, chunk_bytes=chunk_bytes
            )
            want = topk_divergence(logits, ids, lp, sampled, sampled_lp, mask=row_mask)
            for g, w in zip(got, want):
                assert g.dtype == torch.float32 and g.shape == (37,)
                where = f"{dtype} chunk {chunk_bytes} rank {rank}"
                torch.testing.assert_close(g, w, rtol=tol, atol=tol / 10, msg=lambda m: f"{where}: {m}")
    _check_peaked_rows(rank)
    # Checked before any collective, on data every rank holds: all ranks raise, none waits on the others.
    bad = ids.clone()
    bad[0, 0] = VOCAB
    with pytest.raises(TopKInputError, match="outside the vocabulary"):
        vocab_parallel_topk_divergence(shard, rank * half, VOCAB, None, bad, lp, sampled, sampled_lp)
    dist.destroy_process_group()


def _check_peaked_rows(rank: int) -> None:
    """Issue 8.1 on the vocabulary-parallel path: top-1 probability up to 1 - 1e-9, pi == mu and not, bf16 and
    float32 logits. pi(other) is each rank's sum of exp outside A'_t, all-reduced: finite and within issue 8's
    tolerances of the float64 reference that sums the complement directly (before: D_KL = +inf on such rows)."""
    from reference import llm_logits, rollout_topk, topk_mismatch, topk_reference
    from verl_dppo.math.topk import vocab_parallel_topk_divergence

    vocab, rows = 4096, 16
    half = vocab // TP
    for seed, (top1, k, dtype, perturb) in enumerate(
        [
            (1 - 1e-9, 20, torch.bfloat16, 0.0),
            (1 - 1e-7, 1, torch.float32, 0.0),
            (1 - 1e-9, 64, torch.float32, 0.05),
            (1 - 1e-5, 5, torch.bfloat16, 1.0),
        ]
    ):
        logits = llm_logits(rows, vocab, seed, top1_prob=top1).to(dtype)
        mu_logits = logits.double() + perturb * torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed))
        for inside in (True, False):
            _, ids, lp, sampled, sampled_lp = rollout_topk(mu_logits, k, seed, inside)
            shard = logits[:, rank * half : (rank + 1) * half]
            tv, kl = vocab_parallel_topk_divergence(shard, rank * half, vocab, None, ids, lp, sampled, sampled_lp)
            bad_tv, bad_kl = topk_mismatch(tv, kl, *topk_reference(logits, ids, lp, sampled, sampled_lp))
            where = f"top1=1-{1 - top1:.0e} K={k} {dtype} perturb={perturb} inside={inside} rank {rank}"
            assert not bad_tv.any() and not bad_kl.any(), f"{where}: TV {tv.tolist()} KL {kl.tolist()}"


def test_vocab_parallel_topk_divergence_equals_unsharded():
    _spawn(_math_rank)


# ---------------------------------------------------------------------------------------------------------------


def _stub_megatron(tp_rank: int, tp_size: int, tp_group) -> None:
    """Just what verl.models.mcore.util and the hook read from megatron.core; util itself is imported as is (its
    package __init__, which builds Megatron models, is skipped)."""
    import verl

    parallel_state = types.ModuleType("megatron.core.parallel_state")
    parallel_state.get_tensor_model_parallel_rank = lambda: tp_rank
    parallel_state.get_tensor_model_parallel_world_size = lambda: tp_size
    parallel_state.get_tensor_model_parallel_group = lambda: tp_group
    parallel_state.get_context_parallel_world_size = lambda: 1
    parallel_state.get_context_parallel_rank = lambda: 0
    parallel_state.get_context_parallel_group = lambda: None
    packed = types.ModuleType("megatron.core.packed_seq_params")
    packed.PackedSeqParams = type("PackedSeqParams", (), {"__init__": lambda self, **kw: self.__dict__.update(kw)})
    core = types.ModuleType("megatron.core")
    core.parallel_state, core.packed_seq_params = parallel_state, packed
    megatron = types.ModuleType("megatron")
    megatron.core = core
    mcore = types.ModuleType("verl.models.mcore")
    mcore.__path__ = [os.path.join(os.path.dirname(verl.__file__), "models", "mcore")]
    sys.modules.update(
        {
            "megatron": megatron,
            "megatron.core": core,
            "megatron.core.parallel_state": parallel_state,
            "megatron.core.packed_seq_params": packed,
            "verl.models.mcore": mcore,
        }
    )


def _nested(rows):
    return torch.nested.as_nested_tensor(list(rows), layout=torch.jagged)


def _micro_batch(prompt_lens, response_lens, seed):
    """A v1 micro-batch (jagged fields) plus the policy's full-vocabulary logits per sequence and mu per token."""
    from tensordict import TensorDict
    from verl.utils import tensordict_utils as tu

    gen = torch.Generator().manual_seed(seed)
    logits = [torch.randn(p + r, VOCAB, generator=gen) * 2 for p, r in zip(prompt_lens, response_lens)]
    noise = [torch.randn(r, VOCAB, generator=gen, dtype=torch.float64) for r in response_lens]
    mu_logp = [
        torch.log_softmax(row[p - 1 : p - 1 + r].double() + n, -1)
        for row, n, p, r in zip(logits, noise, prompt_lens, response_lens)
    ]
    prompts = [torch.randint(0, VOCAB, (p,), generator=gen) for p in prompt_lens]
    responses = [torch.randint(0, VOCAB, (r,), generator=gen) for r in response_lens]
    for resp, mu in zip(responses, mu_logp):
        resp[::3] = mu[::3].argmax(-1)  # a_t inside the top-K at every third token
    masks = [torch.ones(r, dtype=torch.int64) for r in response_lens]
    masks[0][1] = 0
    topk = [m.topk(K, dim=-1) for m in mu_logp]
    rollout_lp = [m.gather(1, resp[:, None]).squeeze(1).float() for m, resp in zip(mu_logp, responses)]
    data = TensorDict(
        {
            "input_ids": _nested(torch.cat([p, r]) for p, r in zip(prompts, responses)),
            "prompts": _nested(prompts),
            "responses": _nested(responses),
            "response_mask": _nested(masks),
            "rollout_log_probs": _nested(rollout_lp),
            "rollout_topk_ids": _nested(t.indices for t in topk),
            "rollout_topk_logprobs": _nested(t.values.float() for t in topk),
        },
        batch_size=[len(prompt_lens)],
    )
    tu.assign_non_tensor(data, distillation_use_topk=True)
    return data, _nested(logits), mu_logp


def _hook_rank(rank: int, init_file: str) -> None:
    _init(rank, init_file)
    own_group = [dist.new_group([r]) for r in range(TP)][rank]
    for tp_size in (1, TP):
        tp_rank = rank if tp_size == TP else 0
        _stub_megatron(tp_rank, tp_size, dist.group.WORLD if tp_size == TP else own_group)
        for data_format in ("thd", "bshd"):
            _check_hook(tp_rank, tp_size, data_format, f"TP={tp_size} {data_format} rank {rank}")
    dist.destroy_process_group()


def _layout_rank(rank: int, init_file: str) -> None:
    _init(rank, init_file)
    _stub_megatron(rank, TP, dist.group.WORLD)
    for data_format in ("thd", "bshd"):
        _check_hook(rank, TP, data_format, f"FP8 padding {data_format} rank {rank}", fp8=True)
        # 4 padded columns: rank 1's slice ends in them; 2 * VOCAB / 2 + ...: a slice of padding only is covered by
        # the math test below
        _check_hook(rank, TP, data_format, f"padded vocab {data_format} rank {rank}", pad_vocab=4)
    dist.destroy_process_group()


def _check_hook(tp_rank, tp_size, data_format, where, fp8=False, pad_vocab=0):
    """`fp8`: the engine splits with FP8 padding (the model's fp8 in e4m3 / hybrid); `pad_vocab`: the LM head has
    this many padded columns past the model's vocabulary (Megatron's padding to a multiple of TP), with large logits
    that would dominate pi's normaliser if counted. Both reach the hook as the engine worker sets them (LAYOUT_KEY)."""
    import verl.workers.utils.losses as verl_losses
    from verl.models.mcore.util import (
        postprocess_bshd_engine,
        postprocess_thd_engine,
        preprocess_bshd_engine,
        preprocess_thd_engine,
    )
    from verl.workers.utils.padding import no_padding_2_padding

    from helpers import actor_config
    from test_topk_divergence import reference_topk

    prompt_lens, response_lens = [3, 4, 2], [5, 1, 6]  # odd lengths: TP=2 pads every sequence
    data, full_logits, mu_logp = _micro_batch(prompt_lens, response_lens, seed=11)
    if fp8 or pad_vocab:
        from verl.utils import tensordict_utils as tu

        from verl_dppo.patches.megatron_logits_hook import LAYOUT_KEY

        tu.assign_non_tensor(data, **{LAYOUT_KEY: {"use_fp8_padding": fp8, "cp_layout": "zigzag", "vocab_size": VOCAB}})
    head = full_logits
    if pad_vocab:
        head = _nested(
            torch.cat([row, torch.full((row.shape[0], pad_vocab), 8.0)], dim=1) for row in full_logits.unbind()
        )
    # The logits as Megatron's model returns them: the input ids' layout (verl's own split), this rank's vocabulary.
    if data_format == "thd":
        logits, packed_seq_params, _ = preprocess_thd_engine(head, pre_process=True, use_fp8_padding=fp8)
    else:
        logits, attention_mask, _ = preprocess_bshd_engine(head, pre_process=True, use_fp8_padding=fp8)
    local = (VOCAB + pad_vocab) // tp_size
    logits = logits[..., tp_rank * local : (tp_rank + 1) * local].contiguous()
    if data_format == "bshd":  # Megatron's [s, b, v] output seen as (b, s, v): rows are read in memory order
        logits = logits.transpose(0, 1).contiguous().transpose(0, 1)

    hook = functools.partial(verl_losses.ppo_loss, config=actor_config("dppo_topk_kl", topk=K))
    output = hook(student_logits=logits, data=data, data_format=data_format)
    for statistic, key in (("tv", "dppo_topk_tv"), ("kl", "dppo_topk_kl")):
        value = output[key]
        assert value.dtype == torch.float32 and value.shape == logits.shape[:2], where
        if data_format == "thd":
            value = postprocess_thd_engine(value, packed_seq_params, data["input_ids"], len(prompt_lens))
        else:
            value = postprocess_bshd_engine(value, attention_mask)
        per_token = no_padding_2_padding(value, data)
        for i, (p, r) in enumerate(zip(prompt_lens, response_lens)):
            pi = torch.softmax(full_logits[i].double(), -1)
            for t in range(r):
                masked = int(data["response_mask"][i][t]) == 0
                tv, kl = reference_topk(
                    mu_logp[i][t].exp().tolist(), pi[p - 1 + t].tolist(), K, int(data["responses"][i][t])
                )
                want = 0.0 if masked else (tv if statistic == "tv" else kl)
                assert per_token[i, t].item() == pytest.approx(want, rel=1e-4, abs=1e-6), f"{where} {key} [{i},{t}]"

    # Issue 8.5: a token whose rollout statistics are unusable (log mu(a_t) NaN, a top-K log-prob +inf) gets D = NaN
    # (the loss drops it, as in every mode) instead of an error; every other token keeps its value.
    poisoned = {"rollout_log_probs": (2, 0, None, math.nan), "rollout_topk_logprobs": (0, 2, 0, math.inf)}
    for key, (i, t, column, bad) in poisoned.items():
        rows = [row.clone() for row in data[key].unbind()]
        if column is None:
            rows[i][t] = bad
        else:
            rows[i][t, column] = bad
        data[key] = _nested(rows)
    again = hook(student_logits=logits, data=data, data_format=data_format)["dppo_topk_kl"]
    if data_format == "thd":
        again = postprocess_thd_engine(again, packed_seq_params, data["input_ids"], len(prompt_lens))
    else:
        again = postprocess_bshd_engine(again, attention_mask)
    again = no_padding_2_padding(again, data)
    for i, t in ((2, 0), (0, 2)):
        assert math.isnan(again[i, t].item()), f"{where} poisoned [{i},{t}]"
    assert again[1, 0].item() == pytest.approx(per_token[1, 0].item()), where


def test_megatron_logits_hook_matches_reference_thd_and_bshd_tp1_and_tp2():
    _spawn(_hook_rank)


def test_megatron_hook_splits_with_the_engines_fp8_padding_and_keeps_padded_vocabulary_out():
    """Issue 25.5: verl splits the input ids with FP8 padding when the model trains in FP8 (and with its CP
    layout); the hook splits the rollout's fields the same way (it failed its shape check before). Megatron's LM head
    is padded past the model's vocabulary; those columns stay out of pi's normaliser (the rollout's distribution has
    none): D equals the reference over the real vocabulary."""
    _spawn(_layout_rank)


def _padding_only_rank(rank: int, init_file: str) -> None:
    from verl_dppo.math.topk import topk_divergence, vocab_parallel_topk_divergence

    _init(rank, init_file)
    logits, ids, lps, sampled, sampled_lp, mask = _random_rows(5, 12, torch.float64)
    # rank 0 holds the whole real vocabulary, rank 1 only padding (a padded head twice the vocabulary)
    shard = logits if rank == 0 else torch.full_like(logits, 50.0)
    tv, kl = vocab_parallel_topk_divergence(
        shard, rank * VOCAB, 2 * VOCAB, dist.group.WORLD, ids, lps, sampled, sampled_lp, mask, valid_vocab=VOCAB
    )
    want_tv, want_kl = topk_divergence(logits, ids, lps, sampled, sampled_lp, mask)
    torch.testing.assert_close(tv, want_tv, rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(kl, want_kl, rtol=1e-6, atol=1e-9)
    dist.destroy_process_group()


def test_a_slice_of_padding_only_counts_nothing():
    _spawn(_padding_only_rank)


def test_train_batch_turns_the_hook_on_for_the_megatron_engine_and_names_its_settings():
    """The same `TrainingWorker.train_batch` patch serves both engines; Megatron's refusals name its own keys."""
    import verl.workers.utils.losses as verl_losses
    from verl.utils import tensordict_utils as tu
    from verl.workers.config import McoreEngineConfig
    from verl.workers.engine_workers import TrainingWorker

    from helpers import actor_config
    from verl_dppo.patches.engine_workers import prepare_train_batch

    worker = object.__new__(TrainingWorker)
    worker.loss_fn = functools.partial(verl_losses.ppo_loss, config=actor_config("dppo_topk_tv", topk=K))
    worker.engine_config = McoreEngineConfig()
    data, _, _ = _micro_batch([3], [4], seed=0)
    tu.assign_non_tensor(data, distillation_use_topk=False)
    prepare_train_batch(worker, data)
    assert tu.get_non_tensor_data(data, "distillation_use_topk", False) is True
    for setting in ("dynamic_context_parallel", "pad_to_length"):
        worker.engine_config = McoreEngineConfig(**{setting: True}, max_seqlen_per_dp_cp_rank=64)
        with pytest.raises(ValueError, match=f"actor_rollout_ref.actor.megatron.{setting}=False"):
            prepare_train_batch(worker, data)
    worker.engine_config = McoreEngineConfig(context_parallel_size=2)
    worker.engine = types.SimpleNamespace(tf_config=types.SimpleNamespace(experimental_attention_variant="dsv4_hybrid"))
    with pytest.raises(ValueError, match="context_parallel_size=1"):
        prepare_train_batch(worker, data)
