"""The Top-K modes' logits hook on verl 0.9.1's FSDP engine: Eq. (15)/(16) per token from the actor's logits.

Which verl method: `FSDPEngineWithLMHead.prepare_model_outputs` calls the worker's loss function as a logits
processor, `loss_fn(student_logits=(1, nnz, V), data=micro_batch)`, when the micro-batch carries the non-tensor flag
`distillation_use_topk=True` (set for the Top-K modes by `verl_dppo.patches.engine_workers`), in both the
remove-padding and the padded branch; it gathers each returned (1, nnz) tensor across Ulysses sequence parallelism,
strips the packing pad and stores it in `model_output`. The `ppo_loss` wrapper (`workers_utils_losses`) routes that
call here: the rollout's top-K fields are laid out on the packed token stream, sliced like the logits under
Ulysses, and reduced with `verl_dppo.math.topk.topk_divergence` (chunked; no float32 [nnz, V] tensor).
Why no extension point: verl's hook exists for top-K distillation only; nothing else can ask for the logits.
What would make it unnecessary: a logits-processor slot on the policy loss (verl's hook, opened to any loss).
With `use_fused_kernels` there are no logits: `fused_lm_head` calls `fused_lm_head_outputs` here with the LM head's
input and weight instead, and the same outputs reach the loss. The Megatron engine's hook (vocabulary-parallel
logits) is `megatron_logits_hook`; all share `topk_fields` (the rollout's fields on the packed stream).
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch

from verl_dppo.math.fused_topk import fused_topk_divergence
from verl_dppo.math.fused_troll import fused_troll_token_terms
from verl_dppo.math.topk import topk_divergence
from verl_dppo.patches.topk_fields import local_rollout_fields, packed_rollout_fields, unusable_rows  # noqa: F401
from verl_dppo.plugin import troll_mode
from verl_dppo.plugin.modes import logits_hook, topk_modes
from verl_dppo.plugin.troll_mode import troll_outputs
from verl_dppo.plugin.options import policy_loss_get
from verl_dppo.plugin.topk_mode import (
    OUTPUT_KEYS,
    ROLLOUT_SETTINGS,
    TOPK_IDS,
    TOPK_LOGPROBS,
    configured_topk,
    is_topk_mode,
    untied_head_fsdp2_problem,
)

__all__ = ["logits_processor", "fused_lm_head_outputs", "packed_rollout_fields", "troll_outputs", "unusable_rows"]


def _checked_mode(config: Any, data: Any) -> tuple[str, int]:
    loss_mode = policy_loss_get(config, "loss_mode")
    if not is_topk_mode(loss_mode):
        raise RuntimeError(f"the Top-K logits hook ran for loss mode {loss_mode!r}; only {list(topk_modes())} use it")
    for key in (TOPK_IDS, TOPK_LOGPROBS, "rollout_log_probs"):
        if key not in data.keys():
            raise ValueError(
                f"{loss_mode} needs the rollout's {key} in the batch, which has none: set {ROLLOUT_SETTINGS}"
            )
    return loss_mode, configured_topk(config)


def logits_processor(
    config: Any, student_logits: torch.Tensor, data: Any, data_format: Optional[str] = None
) -> dict[str, torch.Tensor]:
    """The engine's logits hook for a Top-K mode: {dppo_topk_tv, dppo_topk_kl}, float32, shaped like the logits'
    leading dims: (1, local_nnz) from FSDP; from Megatron (which passes `data_format`) see `topk_megatron`. For troll:
    TROLL's terms (`troll_outputs`; on Megatron, `megatron_troll_processor`)."""
    loss_mode, k = _checked_mode(config, data)
    if data_format is not None:
        from verl_dppo.patches.megatron_logits_hook import megatron_logits_processor, megatron_troll_processor

        if logits_hook(loss_mode) == "troll":
            return megatron_troll_processor(config, loss_mode, k, student_logits, data, data_format)
        return megatron_logits_processor(loss_mode, k, student_logits, data, data_format)

    logits = student_logits.squeeze(0)
    if isinstance(logits, torch.distributed.tensor.DTensor):
        logits = logits.full_tensor()
    ids, lps, sampled, sampled_lps, mask = local_rollout_fields(loss_mode, k, data, logits.device, logits.shape[0])
    unusable = unusable_rows(lps, sampled_lps, mask)
    if logits_hook(loss_mode) == "troll":
        return troll_outputs(config, logits, ids, lps, sampled, sampled_lps, mask & ~unusable)
    tv, kl = topk_divergence(logits, ids, lps, sampled, sampled_lps, mask=mask & ~unusable)
    return _topk_outputs(tv, kl, unusable)


def _topk_outputs(tv: torch.Tensor, kl: torch.Tensor, unusable: torch.Tensor) -> dict[str, torch.Tensor]:
    tv, kl = tv.masked_fill(unusable, math.nan), kl.masked_fill(unusable, math.nan)
    return {OUTPUT_KEYS["tv"]: tv.unsqueeze(0), OUTPUT_KEYS["kl"]: kl.unsqueeze(0)}


def fused_lm_head_outputs(
    config: Any,
    hidden_states: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    temperature: float,
    data: Any,
    entropy: bool,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """The hook's outputs under `use_fused_kernels` (FSDP), from the LM head's input instead of its logits: what
    verl's `FusedLinearForPPO` returns (log pi(labels) float32 and the entropy, shaped like `labels`; the entropy 0
    unless asked) and the same dict `logits_processor` returns, computed in one fused pass
    (`verl_dppo.math.fused_topk` / `fused_troll`). `labels` are verl's rolled input ids, the sampled tokens a_t at
    the response positions."""
    loss_mode, k = _checked_mode(config, data)
    if hidden_states.dim() == 3 and hidden_states.shape[0] != 1:
        raise ValueError(
            f"{loss_mode} with use_fused_kernels reads the packed token stream: set "
            "actor_rollout_ref.model.use_remove_padding=True"
        )
    if isinstance(weight, torch.distributed.tensor.DTensor):
        raise ValueError(untied_head_fsdp2_problem(loss_mode))
    hidden = hidden_states.reshape(-1, hidden_states.shape[-1])
    flat_labels = labels.reshape(-1).long()
    ids, lps, sampled, sampled_lps, mask = local_rollout_fields(loss_mode, k, data, hidden.device, hidden.shape[0])
    if bool((sampled != flat_labels)[mask].any()):
        raise ValueError(f"{loss_mode}: the engine's labels are not the rollout's responses on the packed stream")
    unusable = unusable_rows(lps, sampled_lps, mask)
    if logits_hook(loss_mode) == "troll":
        options = troll_mode.troll_options(config)
        terms, policy = fused_troll_token_terms(
            hidden,
            weight,
            ids,
            lps,
            flat_labels,
            sampled_lps,
            mask & ~unusable,
            temperature=temperature,
            eps=options.eps,
            support_mass=options.support_mass,
            topk=options.topk,
            entropy=entropy,
        )
        outputs = troll_mode.troll_dict(terms)
        log_p, ent = policy.log_p_sampled, policy.entropy
    else:
        tv, kl, stats = fused_topk_divergence(
            hidden,
            weight,
            ids,
            lps,
            flat_labels,
            sampled_lps,
            mask & ~unusable,
            temperature=temperature,
            entropy=entropy,
        )
        outputs = _topk_outputs(tv, kl, unusable)
        log_p, ent = stats.log_p_sampled, stats.entropy
    ent = ent if ent is not None else torch.zeros_like(log_p)
    return log_p.float().view(labels.shape), ent.view(labels.shape), outputs
