"""Actor side of Top-K DPPO: per-token Eq. (15)/(16) statistics from the actor's logits inside verl's engine.

verl 0.9.1's FSDP engine (`FSDPEngineWithLMHead.prepare_model_outputs`) calls the worker's loss function as a
logits processor, `loss_fn(student_logits=(1, nnz, V), data=micro_batch)`, whenever the micro-batch carries the
non-tensor flag `distillation_use_topk=True`, in both the remove-padding and the padded branch; it then gathers
each returned (1, nnz) tensor across Ulysses sequence parallelism, strips the packing pad, and stores it in
`model_output` as a jagged tensor. That hook was built for top-K distillation; nothing in it is distillation
specific. So, without touching verl's code:

1. `TrainingWorker.train_batch` is wrapped (when `verl.workers.engine_workers` is first imported): if the worker's
   loss function is `ppo_loss` with a `dppo_topk_*` mode, it sets `distillation_use_topk=True` on the batch, after
   refusing the settings under which no logits exist (`use_fused_kernels`) or the hook misaligns (`pad_to_length`).
2. The anchoring wrapper of `ppo_loss` routes a `student_logits=` call here (`logits_processor`): the rollout's
   top-K fields are laid out on the packed token stream, sliced like the logits under Ulysses, and reduced with
   `topk_divergence` (chunked; no float32 [nnz, V] tensor). It returns `dppo_topk_tv` / `dppo_topk_kl`.
3. The loss call then reads them back (anchoring `_extract` -> `BatchExtras.topk_tv/topk_kl`) as D of Eq. (12).

verl's Megatron engine (`MegatronEngineWithLMHead._lm_head_logits_processor`) calls the same hook with
vocabulary-parallel logits and a `data_format`; `topk_megatron` splits the fields like verl's Megatron distillation
and reduces across the tensor-parallel group. Step 1 is the same for both engines (one `TrainingWorker`).
"""

from __future__ import annotations

import functools
import logging
import math
from typing import Any, Optional

import torch

from verl_dppo.topk import topk_divergence

__all__ = [
    "TOPK_MODES",
    "TOPK_IDS",
    "TOPK_LOGPROBS",
    "OUTPUT_KEYS",
    "is_topk_mode",
    "logits_processor",
    "check_anchor",
    "divergence_from_extras",
    "patch_engine_workers",
]

logger = logging.getLogger("verl_dppo")

TOPK_MODES = {"dppo_topk_tv": "tv", "dppo_topk_kl": "kl"}
"""Loss mode -> which statistic of Eq. (15)/(16) is its D."""

TOPK_IDS = "rollout_topk_ids"
"""Batch field: [response_len, K] int per sample, the rollout engine's top-K token ids under mu."""
TOPK_LOGPROBS = "rollout_topk_logprobs"
"""Batch field: [response_len, K] float per sample, log mu of those ids."""

OUTPUT_KEYS = {"tv": "dppo_topk_tv", "kl": "dppo_topk_kl"}
"""model_output keys the logits processor fills: (nnz,) per-token statistics on the packed token stream."""

ROLLOUT_SETTINGS = (
    "actor_rollout_ref.rollout.name=vllm (or sglang), actor_rollout_ref.rollout.calculate_log_probs=True and "
    "trainer.use_v1=True (the plugin then requests K = actor_rollout_ref.actor.policy_loss.topk log-probs per token)"
)


def is_topk_mode(loss_mode: Optional[str]) -> bool:
    return loss_mode in TOPK_MODES


def _policy_loss_get(config: Any, key: str, default: Any = None) -> Any:
    policy_loss = config.get("policy_loss", None) if hasattr(config, "get") else getattr(config, "policy_loss", None)
    if policy_loss is None:
        return default
    getter = getattr(policy_loss, "get", None)
    return getter(key, default) if getter is not None else getattr(policy_loss, key, default)


def configured_topk(config: Any) -> int:
    topk = _policy_loss_get(config, "topk", None)
    if topk is None:
        raise ValueError(
            "Top-K DPPO needs policy_loss.topk: set actor_rollout_ref.actor.policy_loss._target_=verl_dppo.DPPOLossConfig "
            "(its topk defaults to 20; override with +actor_rollout_ref.actor.policy_loss.topk=K)"
        )
    return int(topk)


def _jagged_values(data: Any, key: str) -> torch.Tensor:
    value = data[key]
    if not value.is_nested:
        raise ValueError(f"Top-K DPPO expects {key} as a jagged (nested) tensor, as verl's v1 trainer builds it")
    return value.values()


def _packed_layout(data: Any, total_nnz: int):
    """Positions in the packed token stream whose logits predict each response token (the engine's left shift)."""
    input_ids = data["input_ids"]
    prompts, responses = data["prompts"], data["responses"]
    if not (input_ids.is_nested and prompts.is_nested and responses.is_nested):
        raise ValueError(
            "Top-K DPPO runs on verl's no-padding (v1) micro-batches: set trainer.use_v1=True "
            "(input_ids / prompts / responses must be jagged tensors)"
        )
    seq_offsets = input_ids.offsets()[:-1].long()
    prompt_lens = prompts.offsets().diff().long()
    response_lens = responses.offsets().diff().long()
    if int(seq_offsets.numel()) and int(input_ids.offsets()[-1]) != total_nnz:
        raise ValueError(f"packed length {int(input_ids.offsets()[-1])} != logits length {total_nnz}")
    if bool((prompt_lens == 0).any()):
        raise ValueError("Top-K DPPO needs a non-empty prompt in every sample (the first response token's logits)")
    row = torch.repeat_interleave(torch.arange(response_lens.numel(), device=response_lens.device), response_lens)
    first = responses.offsets()[:-1].long()
    t = torch.arange(row.numel(), device=row.device) - first[row]
    return seq_offsets[row] + prompt_lens[row] - 1 + t, response_lens


def _slice_for_sequence_parallel(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    from verl.utils.ulysses import get_ulysses_sequence_parallel_world_size, slice_input_tensor

    if get_ulysses_sequence_parallel_world_size() <= 1:
        return tensors
    # Same pad-then-slice rule the engine applies to input_ids (and distillation to its teacher tensors).
    return [slice_input_tensor(t.unsqueeze(0), dim=1).squeeze(0) for t in tensors]


def packed_rollout_fields(loss_mode: str, k: int, data: Any, device: torch.device):
    """The rollout's per-token fields laid out on the full packed token stream (prompt positions masked out): the
    row at position p holds the statistics of the token that the logits at p predict (the engine's left shift).

    Returns (topk_ids [nnz, K] long, topk_logprobs [nnz, K] float32, sampled_ids [nnz] long,
    sampled_logprobs [nnz] float32, mask [nnz] bool), nnz = the micro-batch's packed length."""
    topk_ids = _jagged_values(data, TOPK_IDS)
    topk_logprobs = _jagged_values(data, TOPK_LOGPROBS)
    if topk_ids.dim() != 2 or topk_ids.shape[1] != k:
        raise ValueError(
            f"{loss_mode}: the batch carries {topk_ids.shape[-1] if topk_ids.dim() == 2 else '?'} top-K log-probs per "
            f"token but policy_loss.topk={k}; the rollout and the loss must use the same K (set only "
            "actor_rollout_ref.actor.policy_loss.topk; the plugin passes it to the rollout)"
        )
    global_nnz = int(data["input_ids"].offsets()[-1])
    positions, _ = _packed_layout(data, global_nnz)
    if topk_ids.shape[0] != positions.numel():
        raise ValueError(
            f"{loss_mode}: {topk_ids.shape[0]} rows of {TOPK_IDS} for {positions.numel()} response tokens; the "
            "top-K fields must be aligned with `responses` (one row per response token)"
        )
    positions = positions.to(device)
    full_ids = torch.zeros(global_nnz, k, dtype=torch.long, device=device)
    full_lp = torch.zeros(global_nnz, k, dtype=torch.float32, device=device)
    full_sampled = torch.zeros(global_nnz, dtype=torch.long, device=device)
    full_sampled_lp = torch.zeros(global_nnz, dtype=torch.float32, device=device)
    full_mask = torch.zeros(global_nnz, dtype=torch.bool, device=device)
    full_ids[positions] = topk_ids.to(device).long()
    full_lp[positions] = topk_logprobs.to(device).float()
    full_sampled[positions] = _jagged_values(data, "responses").to(device).long()
    full_sampled_lp[positions] = _jagged_values(data, "rollout_log_probs").to(device).float()
    full_mask[positions] = _jagged_values(data, "response_mask").to(device).bool()
    return full_ids, full_lp, full_sampled, full_sampled_lp, full_mask


def unusable_rows(topk_logprobs: torch.Tensor, sampled_logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Rows of `mask` whose rollout statistics give no divergence: log mu(a_t) NaN or +-inf (the loss drops such a
    token for every mode, README "Bad input"), or a top-K log-prob NaN or +inf (-inf is a probability of 0, valid).
    The hook leaves them out of the reduction and reports D = NaN there, so the loss drops them too."""
    bad = ~torch.isfinite(sampled_logprobs) | torch.isnan(topk_logprobs).any(dim=-1) | (topk_logprobs == math.inf).any(dim=-1)
    return bad & mask


def logits_processor(
    config: Any, student_logits: torch.Tensor, data: Any, data_format: Optional[str] = None
) -> dict[str, torch.Tensor]:
    """The engine's logits hook for a Top-K mode: {dppo_topk_tv, dppo_topk_kl}, float32, shaped like the logits'
    leading dims: (1, local_nnz) from FSDP; from Megatron (which passes `data_format`) see `topk_megatron`."""
    loss_mode = _policy_loss_get(config, "loss_mode")
    if not is_topk_mode(loss_mode):
        raise RuntimeError(f"the Top-K logits hook ran for loss mode {loss_mode!r}; only {sorted(TOPK_MODES)} use it")
    for key in (TOPK_IDS, TOPK_LOGPROBS, "rollout_log_probs"):
        if key not in data.keys():
            raise ValueError(f"{loss_mode} needs the rollout's {key} in the batch, which has none: set {ROLLOUT_SETTINGS}")
    k = configured_topk(config)
    if data_format is not None:
        from verl_dppo.adapter.topk_megatron import megatron_logits_processor

        return megatron_logits_processor(loss_mode, k, student_logits, data, data_format)

    logits = student_logits.squeeze(0)
    if isinstance(logits, torch.distributed.tensor.DTensor):
        logits = logits.full_tensor()
    fields = packed_rollout_fields(loss_mode, k, data, logits.device)
    full_ids, full_lp, full_sampled, full_sampled_lp, full_mask = _slice_for_sequence_parallel(list(fields))
    if full_mask.shape[0] != logits.shape[0]:
        raise ValueError(
            f"{loss_mode}: {logits.shape[0]} logit rows for {full_mask.shape[0]} packed tokens; static packing "
            "(actor_rollout_ref.actor.fsdp_config.pad_to_length) is not supported with Top-K: disable it"
        )
    unusable = unusable_rows(full_lp, full_sampled_lp, full_mask)
    tv, kl = topk_divergence(logits, full_ids, full_lp, full_sampled, full_sampled_lp, mask=full_mask & ~unusable)
    tv, kl = tv.masked_fill(unusable, math.nan), kl.masked_fill(unusable, math.nan)
    return {OUTPUT_KEYS["tv"]: tv.unsqueeze(0), OUTPUT_KEYS["kl"]: kl.unsqueeze(0)}


def check_anchor(mode_name: str, anchor: str) -> None:
    if anchor != "rollout":
        raise ValueError(
            f"{mode_name} measures D(mu || pi) on mu's top-K, which only the rollout engine reports; there is no "
            "top-K of a recomputed policy, so policy_loss.anchor='recompute' is not defined for it: use "
            "anchor='rollout' (or dppo_binary_tv/kl for the recomputed-anchor ablation)"
        )


def divergence_from_extras(mode_name: str, extras: Any, anchor: str, valid: torch.Tensor) -> torch.Tensor:
    """D of Eq. (12) for a Top-K mode: the hook's statistic, [batch, response_len], 0 outside `valid`; NaN where
    the token's rollout statistics are unusable (the loss drops those tokens)."""
    check_anchor(mode_name, anchor)
    statistic = TOPK_MODES[mode_name]
    value = getattr(extras, f"topk_{statistic}", None) if extras is not None else None
    if value is None:
        raise ValueError(
            f"{mode_name} needs the per-token Top-K statistics that the actor's logits hook computes, but this "
            "micro-batch has none. Either the batch lacks the rollout's top-K fields (set "
            f"{ROLLOUT_SETTINGS}), or the loss was not called through verl's engine with the hook on "
            "(actor_rollout_ref.model.use_fused_kernels must be False: fused kernels never materialise logits)"
        )
    if tuple(value.shape) != tuple(valid.shape):
        raise ValueError(f"{mode_name}: Top-K statistics {tuple(value.shape)} vs response {tuple(valid.shape)}")
    # NaN marks a token whose rollout statistics are unusable (the hook's `unusable_rows`): the loss drops it.
    return torch.where(valid, value.detach().float(), torch.zeros_like(value, dtype=torch.float32))


def _topk_loss_mode(loss_fn: Any) -> Optional[str]:
    """The Top-K loss mode a worker's loss function runs, or None for any other loss."""
    if not isinstance(loss_fn, functools.partial):
        return None
    config = loss_fn.keywords.get("config")
    if config is None:
        return None
    mode = _policy_loss_get(config, "loss_mode")
    if not is_topk_mode(mode):
        return None
    if "distillation_config" in loss_fn.keywords:
        raise ValueError(f"{mode} cannot run together with distillation (both own the logits hook): disable one")
    return mode


def _fused_kernels_problem(mode: str) -> str:
    return (
        f"{mode} needs the actor's logits, which fused kernels never materialise: set "
        "actor_rollout_ref.model.use_fused_kernels=False"
    )


def _pad_to_length_problem(mode: str, megatron: bool) -> str:
    engine_key = "actor_rollout_ref.actor.megatron" if megatron else "actor_rollout_ref.actor.fsdp_config"
    return (
        f"{mode}: static packing shifts the logits against the rollout's top-K rows: set "
        f"{engine_key}.pad_to_length=False"
    )


def _dynamic_cp_problem(mode: str) -> str:
    return (
        f"{mode}: dynamic context parallelism schedules micro-batches without the logits hook (verl refuses "
        "distillation there too): set actor_rollout_ref.actor.megatron.dynamic_context_parallel=False"
    )


def unsupported_settings(config: Any) -> list[str]:
    """What in a composed run config (actor_rollout_ref...) keeps a Top-K mode's logits hook from running; [] when
    nothing does or the loss is not Top-K. `prepare_train_batch` refuses the same settings at the first update."""
    arr = config.actor_rollout_ref
    mode = arr.actor.policy_loss.get("loss_mode")
    if not is_topk_mode(mode):
        return []
    megatron = arr.actor.get("strategy") == "megatron"
    engine = arr.actor.get("megatron" if megatron else "fsdp_config", None) or {}
    problems = []
    if arr.model.get("use_fused_kernels", False):
        problems.append(_fused_kernels_problem(mode))
    if engine.get("pad_to_length", False):
        problems.append(_pad_to_length_problem(mode, megatron))
    if megatron and engine.get("dynamic_context_parallel", False):
        problems.append(_dynamic_cp_problem(mode))
    return problems


def prepare_train_batch(worker: Any, data: Any) -> None:
    """Turn the engine's logits hook on for a Top-K mode, refusing settings under which it cannot work."""
    mode = _topk_loss_mode(getattr(worker, "loss_fn", None))
    if mode is None:
        return
    from verl.utils import tensordict_utils as tu

    engine_config = getattr(worker, "engine_config", None)
    use_fused = tu.get_non_tensor_data(data, key="use_fused_kernels", default=None)
    if use_fused is None:
        use_fused = getattr(engine_config, "use_fused_kernels", False)
    if use_fused:
        raise ValueError(_fused_kernels_problem(mode))
    megatron = getattr(engine_config, "strategy", None) == "megatron"
    if getattr(engine_config, "pad_to_length", False):
        raise ValueError(_pad_to_length_problem(mode, megatron))
    if megatron and getattr(engine_config, "dynamic_context_parallel", False):
        raise ValueError(_dynamic_cp_problem(mode))
    if megatron:
        from verl_dppo.adapter.topk_megatron import check_context_parallel_layout

        check_context_parallel_layout(mode, engine_config, getattr(worker, "engine", None))
    missing = [key for key in (TOPK_IDS, TOPK_LOGPROBS, "rollout_log_probs") if key not in data.keys()]
    if missing:
        raise ValueError(f"{mode} needs {', '.join(missing)} in the training batch: set {ROLLOUT_SETTINGS}")
    tu.assign_non_tensor(data, distillation_use_topk=True, distillation_only=False)


def patch_engine_workers(module: Any) -> None:
    """Wrap `TrainingWorker.train_batch` (keeps verl's `@register` metadata through functools.wraps): turn the logits
    hook on for the Top-K modes, and make the mini-batch's ratio diagnostics exact (adapter.metrics) once verl has
    gathered them from every data-parallel rank, before `train_mini_batch` averages them."""
    from verl_dppo.adapter.topk_import_hook import patch_once

    def make(original):
        def train_batch(self, data, *args, **kwargs):
            prepare_train_batch(self, data)
            output = original(self, data, *args, **kwargs)
            if output is not None:  # the rank that returns the mini-batch's metrics, gathered over the DP group
                from verl.utils import tensordict_utils as tu

                from verl_dppo.adapter.metrics import exact_ratio_metrics

                metrics = tu.get(output, "metrics", default=None)
                if isinstance(metrics, dict):
                    exact_ratio_metrics(metrics)
            return output

        return train_batch

    patch_once(module.TrainingWorker, "train_batch", make)
