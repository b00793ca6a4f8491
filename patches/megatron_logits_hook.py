"""Top-K DPPO and TROLL on verl 0.9.1's Megatron engine: the logits hook with vocabulary-parallel logits.

`MegatronEngineWithLMHead._lm_head_logits_processor` calls the worker's loss function as
`loss_fn(student_logits=logits, data=micro_batch, data_format="thd" | "bshd")` when the micro-batch carries
`distillation_use_topk=True` (set by `engine_workers.prepare_train_batch`, the same `TrainingWorker.train_batch` patch
as for FSDP). The logits are (1, T / cp, V / tp) for THD (the packed stream, each sequence padded to the TP x CP
alignment) or (bsz, S / cp, V / tp) for BSHD, already divided by the temperature. verl then gathers each returned
(bsz, seqlen / cp) tensor across context parallelism (`postprocess_thd_engine` / `postprocess_bshd_engine`) into a
jagged per-sequence tensor, the layout of `log_probs`, which the loss call reads back.

So, like verl's own Megatron distillation loss (`trainer/distillation/megatron/losses.py`): lay the rollout's
fields out on each full sequence, split them with the very functions that split the input ids
(`preprocess_thd_engine` / `preprocess_bshd_engine`), and reduce across the tensor-parallel group
(`verl_dppo.math.topk.vocab_parallel_topk_divergence`: all-reduced max and sum of exp, each id's logit from its owner).

TROLL (`megatron_troll_processor`) projects each token's row gathered across the tensor-parallel ranks with
megatron-core's own mapping (backward: the local shard of the gradient), the FSDP path's projection on the same rows.

Why no extension point, and what would make this unnecessary: as for `fsdp_logits_hook` (verl's logits hook exists
for top-K distillation only); a logits-processor slot on the policy loss would serve both engines.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from verl_dppo.patches.topk_fields import packed_rollout_fields, unusable_rows
from verl_dppo.plugin.topk_mode import OUTPUT_KEYS
from verl_dppo.math.topk import vocab_parallel_topk_divergence

__all__ = [
    "LAYOUT_KEY",
    "megatron_layout",
    "megatron_logits_processor",
    "megatron_troll_processor",
    "check_context_parallel_layout",
]


def check_context_parallel_layout(mode: str, engine_config: Any, engine: Any) -> None:
    """The hook splits like verl's zigzag CP layout; models whose attention needs the contiguous one are refused."""
    tf_config = getattr(engine, "tf_config", None)
    if (
        getattr(tf_config, "experimental_attention_variant", None) == "dsv4_hybrid"
        and getattr(engine_config, "context_parallel_size", 1) > 1
    ):
        raise ValueError(
            f"{mode}: this model's contiguous context-parallel layout is not the zigzag split the hook mirrors: set "
            "actor_rollout_ref.actor.megatron.context_parallel_size=1"
        )


LAYOUT_KEY = "dppo_megatron_layout"
"""Non-tensor key of the training batch (set by `engine_workers.prepare_train_batch` from the engine): the split
arguments verl's `gptmodel_forward_model_engine` passes to `preprocess_*_engine` for the input ids
(models/mcore/model_forward.py:289, 303-309, 409-413): `use_fp8_padding` (the model's fp8 in e4m3 / hybrid) and
`cp_layout`; and `vocab_size`, the model's own vocabulary (Megatron pads its LM head beyond it)."""


def megatron_layout(engine: Any, model_config: Any) -> dict:
    """What `LAYOUT_KEY` holds, read from verl's Megatron engine and model config as its forward reads them."""
    tf_config = getattr(engine, "tf_config", None)
    fp8 = getattr(tf_config, "fp8", None)
    variant = getattr(tf_config, "experimental_attention_variant", None)
    hf_config = getattr(model_config, "hf_config", None)
    vocab = getattr(hf_config, "vocab_size", None)
    return {
        "use_fp8_padding": fp8 in ("e4m3", "hybrid"),
        # verl's MegatronEngine._get_context_parallel_layout
        "cp_layout": "contiguous" if variant == "dsv4_hybrid" else "zigzag",
        "vocab_size": int(vocab) if vocab else None,
    }


def _layout(data: Any) -> dict:
    from verl.utils import tensordict_utils as tu

    return tu.get_non_tensor_data(data, key=LAYOUT_KEY, default=None) or {}


def _split_like_input_ids(values: torch.Tensor, data: Any, data_format: str) -> torch.Tensor:
    """Packed [nnz, ...] -> the local (bsz | 1, seqlen / cp, ...) block that the engine's split gives input_ids,
    with the engine's own FP8 padding and context-parallel layout."""
    from verl.models.mcore.util import preprocess_bshd_engine, preprocess_thd_engine
    from verl.utils import tensordict_utils as tu

    layout = _layout(data)
    fp8 = bool(layout.get("use_fp8_padding", False))
    nested = torch.nested.nested_tensor_from_jagged(values, data["input_ids"].offsets())
    if data_format == "thd":
        return preprocess_thd_engine(
            nested, pre_process=True, use_fp8_padding=fp8, cp_layout=layout.get("cp_layout", "zigzag")
        )[0]
    if data_format == "bshd":
        forced = tu.get_non_tensor_data(data, key="forced_max_seqlen", default=None)
        return preprocess_bshd_engine(nested, pre_process=True, use_fp8_padding=fp8, forced_max_seqlen=forced)[0]
    raise ValueError(f"unknown Megatron data_format {data_format!r} (verl 0.9.1 uses 'thd' or 'bshd')")


class _Local:
    """The rollout's fields split like the engine splits input_ids, as rows in the logits' memory order (a view of
    Megatron's logits, which may be [s, b, v] transposed to (b, s, v)), and the way back to the logits' shape."""

    def __init__(self, loss_mode: str, k: int, logits: torch.Tensor, data: Any, data_format: str):
        ids, logprobs, sampled, sampled_logprobs, mask = packed_rollout_fields(loss_mode, k, data, logits.device)
        # Three splits, not five: a_t rides as column K of the ids and log-probs.
        slot_ids = _split_like_input_ids(torch.cat([ids, sampled[:, None]], dim=1), data, data_format)
        slot_lps = _split_like_input_ids(torch.cat([logprobs, sampled_logprobs[:, None]], dim=1), data, data_format)
        unusable = unusable_rows(logprobs, sampled_logprobs, mask)
        # One split for both masks: bit 0 = the row is read, bit 1 = its rollout statistics are unusable (D = NaN).
        flags = _split_like_input_ids(
            (mask & ~unusable).to(torch.int8) + 2 * unusable.to(torch.int8), data, data_format
        )
        mask, unusable = (flags & 1).bool(), (flags & 2).bool()
        if tuple(mask.shape) != tuple(logits.shape[:2]):
            raise ValueError(
                f"{loss_mode}: Megatron's logits are {tuple(logits.shape[:2])} tokens but the rollout's fields split "
                f"to {tuple(mask.shape)}: the engine pads differently (pad_to_length); disable "
                "actor_rollout_ref.actor.megatron.pad_to_length for Top-K"
            )
        self.transposed = not logits.is_contiguous() and logits.transpose(0, 1).is_contiguous()
        self.lead = (logits.shape[1], logits.shape[0]) if self.transposed else tuple(logits.shape[:2])
        slot_ids, slot_lps = self.rows(slot_ids), self.rows(slot_lps)
        self.ids, self.logprobs = slot_ids[:, :k], slot_lps[:, :k]
        self.sampled, self.sampled_logprobs = slot_ids[:, k], slot_lps[:, k]
        self.mask, self.unusable = self.rows(mask), self.rows(unusable)

    def rows(self, t: torch.Tensor) -> torch.Tensor:
        t = t.transpose(0, 1) if self.transposed else t
        return t.reshape(-1, *t.shape[2:])

    def shaped(self, t: torch.Tensor) -> torch.Tensor:
        t = t.reshape(self.lead)
        return t.transpose(0, 1).contiguous() if self.transposed else t


def megatron_logits_processor(
    loss_mode: str, k: int, logits: torch.Tensor, data: Any, data_format: str
) -> dict[str, torch.Tensor]:
    """{dppo_topk_tv, dppo_topk_kl} as float32 tensors shaped like `logits.shape[:2]`."""
    from megatron.core import parallel_state as mpu

    local = _Local(loss_mode, k, logits, data, data_format)
    local_vocab = logits.shape[-1]
    tp_rank, tp_size = mpu.get_tensor_model_parallel_rank(), mpu.get_tensor_model_parallel_world_size()
    tv, kl = vocab_parallel_topk_divergence(
        local.rows(logits),
        vocab_start=tp_rank * local_vocab,
        vocab_size=tp_size * local_vocab,
        group=mpu.get_tensor_model_parallel_group(),
        rollout_topk_ids=local.ids,
        rollout_topk_logprobs=local.logprobs,
        sampled_ids=local.sampled,
        rollout_sampled_logprobs=local.sampled_logprobs,
        mask=local.mask,
        valid_vocab=_layout(data).get("vocab_size"),
    )
    tv, kl = tv.masked_fill(local.unusable, math.nan), kl.masked_fill(local.unusable, math.nan)
    return {OUTPUT_KEYS["tv"]: local.shaped(tv), OUTPUT_KEYS["kl"]: local.shaped(kl)}


def megatron_troll_processor(
    config: Any, loss_mode: str, k: int, logits: torch.Tensor, data: Any, data_format: str
) -> dict[str, torch.Tensor]:
    """TROLL's terms (`troll_mode.OUTPUT_KEYS`) on Megatron, shaped like `logits.shape[:2]`: each token's vocabulary
    row gathered across the tensor-parallel ranks with Megatron's own mapping (forward all-gather of the vocabulary
    shards, backward the local shard of the gradient: each rank computes the same loss, as for Megatron's
    vocabulary-parallel cross entropy), cut to the model's vocabulary (Megatron pads its LM head), then the FSDP
    path's projection (`troll_mode.troll_outputs`) on those rows: the same numbers on the same weights. Memory:
    one full-vocabulary copy of the micro-batch's logits per rank (what FSDP holds per rank), made before verl's
    vocabulary-parallel log-prob, which may work in the logits in place."""
    from megatron.core import parallel_state as mpu
    from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

    from verl_dppo.plugin.troll_mode import troll_outputs

    local = _Local(loss_mode, k, logits, data, data_format)
    if mpu.get_tensor_model_parallel_world_size() > 1:
        full = gather_from_tensor_model_parallel_region(logits)
    else:
        full = logits.clone()
    vocab = _layout(data).get("vocab_size") or full.shape[-1]
    rows = local.rows(full)[:, :vocab]
    outputs = troll_outputs(
        config, rows, local.ids, local.logprobs, local.sampled, local.sampled_logprobs, local.mask & ~local.unusable
    )
    return {key: local.shaped(value.squeeze(0)) for key, value in outputs.items()}
