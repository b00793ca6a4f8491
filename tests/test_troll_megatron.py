"""TROLL on Megatron's vocabulary-parallel logits (issue 35.4), with real megatron-core: two CPU processes in a gloo
group are two tensor-parallel ranks (megatron-core's own parallel state and all-gather mapping, the plugin's CPU shim).

verl's Megatron engine calls the loss as a logits hook, `ppo_loss(student_logits=<this rank's vocabulary shard>,
data=..., data_format="bshd")`. Its TROLL terms (log p(a_t), the regression KL, the diagnostics) and the gradient
they send to each rank's shard must equal the FSDP path's (`troll_mode.troll_outputs` on the full rows, the
same projection) at TP=1 and TP=2, with Megatron's padded LM-head columns left out (zero gradient there).
"""

from __future__ import annotations

import os
import sys
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from verl_dppo.rehearsal.setups.megatron_cpu import megatron_cpu_problems

pytestmark = pytest.mark.skipif(
    bool(megatron_cpu_problems(None)), reason="megatron-core 0.16.1 / mbridge 0.15.1 are not installed: `make venv`"
)

TP, PAD = 2, 4
HERE = os.path.dirname(os.path.abspath(__file__))


def _rank(rank: int, init_file: str) -> None:
    os.environ["VERL_PLATFORM"] = "cpu"
    sys.path.insert(0, HERE)
    torch.set_num_threads(1)
    import verl  # noqa: F401  (the plugin and its patches)
    from megatron.core import parallel_state as mpu

    from verl_dppo.rehearsal import megatron_shim

    megatron_shim.install()  # as verl's MegatronEngine.__init__ does first on the CPU platform

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=TP)
    for tp in (1, TP):
        mpu.initialize_model_parallel(tensor_model_parallel_size=tp)
        _check(mpu.get_tensor_model_parallel_rank(), tp, f"TP={tp} rank {rank}")
        mpu.destroy_model_parallel()
    dist.destroy_process_group()


def _check(tp_rank: int, tp: int, where: str) -> None:
    import verl.workers.utils.losses as verl_losses
    from verl.models.mcore.util import preprocess_bshd_engine
    from verl.utils import tensordict_utils as tu

    from helpers import actor_config
    from test_topk_megatron import K, VOCAB, _micro_batch, _nested

    from verl_dppo.plugin.troll_mode import troll_outputs
    from verl_dppo.patches.megatron_logits_hook import LAYOUT_KEY, _Local
    from verl_dppo.plugin import troll_mode

    config = actor_config("troll", topk=K)
    data, full_logits, _ = _micro_batch([3, 4, 2], [5, 1, 6], seed=5)
    tu.assign_non_tensor(data, **{LAYOUT_KEY: {"use_fp8_padding": False, "cp_layout": "zigzag", "vocab_size": VOCAB}})
    # Megatron's LM head: the vocabulary padded past the model's (large logits that must not count), in BSHD
    head = _nested(torch.cat([row, torch.full((row.shape[0], PAD), 6.0)], dim=1) for row in full_logits.unbind())
    padded, _, _ = preprocess_bshd_engine(head, pre_process=True)
    local_vocab = (VOCAB + PAD) // tp
    shard = padded[..., tp_rank * local_vocab : (tp_rank + 1) * local_vocab].clone().requires_grad_(True)

    output = verl_losses.ppo_loss(config, student_logits=shard, data=data, data_format="bshd")
    weights = {"troll_log_p": 1.0, "troll_regression_kl": 0.5}
    (sum((output[key] * w).sum() for key, w in weights.items())).backward()

    reference_logits = padded[..., :VOCAB].clone().requires_grad_(True)
    local = _Local("troll", K, reference_logits, data, "bshd")
    rows = local.rows(reference_logits)
    reference = troll_outputs(
        config, rows, local.ids, local.logprobs, local.sampled, local.sampled_logprobs, local.mask & ~local.unusable
    )
    (sum((reference[key] * w).sum() for key, w in weights.items())).backward()

    for key in troll_mode.OUTPUT_KEYS.values():
        got, want = output[key].reshape(-1), local.shaped(reference[key].squeeze(0)).reshape(-1)
        assert torch.allclose(got.double(), want.double(), rtol=1e-5, atol=1e-6), (where, key)
    assert output["troll_valid"].sum() > 0 and output["troll_projected"].sum() > 0, where  # rows were projected
    grad = reference_logits.grad
    full_grad = torch.cat([grad, torch.zeros(*grad.shape[:2], PAD)], dim=-1)
    want_grad = full_grad[..., tp_rank * local_vocab : (tp_rank + 1) * local_vocab]
    assert torch.allclose(shard.grad, want_grad, rtol=1e-5, atol=1e-7), (where, (shard.grad - want_grad).abs().max())
    assert shard.grad.abs().sum() > 0, where


def test_troll_on_vocabulary_parallel_logits_equals_the_fsdp_path_tp1_and_tp2():
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_rank, args=(os.path.join(tmp, "init"),), nprocs=TP, join=True)
