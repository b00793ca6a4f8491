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
The Megatron engine's hook (vocabulary-parallel logits) is `megatron_logits_hook`; both share `packed_rollout_fields`.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch

from verl_dppo.math.topk import topk_divergence
from verl_dppo.math.troll import troll_token_terms
from verl_dppo.plugin import troll_mode
from verl_dppo.plugin.topk_mode import (
    OUTPUT_KEYS,
    ROLLOUT_SETTINGS,
    TOPK_MODES,
    TROLL_MODES,
    TOPK_IDS,
    TOPK_LOGPROBS,
    configured_topk,
    is_topk_mode,
    megatron_troll_problem,
    policy_loss_get,
)

__all__ = ["logits_processor", "packed_rollout_fields", "troll_outputs", "unusable_rows"]


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
    leading dims: (1, local_nnz) from FSDP; from Megatron (which passes `data_format`) see `topk_megatron`. For troll:
    TROLL's terms (`troll_outputs`), FSDP only."""
    loss_mode = policy_loss_get(config, "loss_mode")
    if not is_topk_mode(loss_mode):
        raise RuntimeError(
            f"the Top-K logits hook ran for loss mode {loss_mode!r}; only {sorted(TOPK_MODES) + list(TROLL_MODES)} use it"
        )
    for key in (TOPK_IDS, TOPK_LOGPROBS, "rollout_log_probs"):
        if key not in data.keys():
            raise ValueError(f"{loss_mode} needs the rollout's {key} in the batch, which has none: set {ROLLOUT_SETTINGS}")
    k = configured_topk(config)
    if data_format is not None:
        if loss_mode in TROLL_MODES:
            raise ValueError(megatron_troll_problem(loss_mode))
        from verl_dppo.patches.megatron_logits_hook import megatron_logits_processor

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
    if loss_mode in TROLL_MODES:
        return troll_outputs(config, logits, full_ids, full_lp, full_sampled, full_sampled_lp, full_mask & ~unusable)
    tv, kl = topk_divergence(logits, full_ids, full_lp, full_sampled, full_sampled_lp, mask=full_mask & ~unusable)
    tv, kl = tv.masked_fill(unusable, math.nan), kl.masked_fill(unusable, math.nan)
    return {OUTPUT_KEYS["tv"]: tv.unsqueeze(0), OUTPUT_KEYS["kl"]: kl.unsqueeze(0)}




def troll_outputs(config: Any, logits: torch.Tensor, topk_ids: torch.Tensor, topk_logprobs: torch.Tensor,
                  sampled_ids: torch.Tensor, sampled_logprobs: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """TROLL's per-token terms on the packed stream, (1, local_nnz) float32 each, under `troll_mode.OUTPUT_KEYS`.

    Called inside verl's training forward (no `no_grad`), so log p(a_t) and the regression KL stay attached to the
    logits: verl's engine stores them in model_output as it does the distillation losses, which it back-propagates
    through. `troll_token_terms` saves the logits themselves (no copy) and reads them again in backward; verl's
    flash-attn cross entropy for log_probs writes into the logits in place only if a gradient reaches verl's own
    log_prob, which the troll loss never uses (`verl_dppo.patches.engine_workers` disables that kernel for a run
    whose ppo_loss adds a KL loss on log_prob). Rows outside `mask` hold 0 and valid = 0."""
    options = troll_mode.troll_options(config)
    terms = troll_token_terms(
        logits, topk_ids, topk_logprobs, sampled_ids, sampled_logprobs, mask,
        eps=options.eps, support_mass=options.support_mass, topk=options.topk,
    )
    values = {"log_p": terms.log_p_sampled, "regression_kl": terms.regression_kl, "log_mu": terms.log_mu_sampled,
              **terms.diagnostics}
    return {key: values[term].float().unsqueeze(0) for term, key in troll_mode.OUTPUT_KEYS.items()}
