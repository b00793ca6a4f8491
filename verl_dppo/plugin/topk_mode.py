"""The Top-K family: its modes' settings and loss side (which statistic is D, the batch fields, what cannot run).

    dppo_topk_tv   Eq. (12) with D = the TV between mu and pi on A'_t = mu's top-K U {a_t} U "other"   (Eq. 15)
    dppo_topk_kl   the same with the KL                                                                 (Eq. 16)

The loss is Eq. (11) (`LossFamily.loss_matrix`); D comes from the engine's logits hook (`FAMILY.hook_terms`).

"Top-K mode" here means every mode that reads the rollout's top-K inside the engine's logits hook: the dppo_topk_*
modes and `troll` (whose loss side is `verl_dppo.plugin.troll_mode`). They share the batch fields, K's hand-over
to the rollout servers, the hook and the settings under which it cannot run.

The statistics themselves are computed inside verl's engine by the logits hook (`verl_dppo.patches.fsdp_logits_hook`,
`verl_dppo.patches.megatron_logits_hook`) with the math of `verl_dppo.math.topk`, or, under the FSDP engine's
`use_fused_kernels`, fused with the LM head (`verl_dppo.patches.fused_lm_head`, `verl_dppo.math.fused_topk`); the
loss reads them back here.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from verl_dppo.plugin.loss_family import LossFamily, LossMode, Tokens
from verl_dppo.plugin.modes import is_topk_mode, mode_named
from verl_dppo.plugin.options import checked, policy_loss_get

__all__ = [
    "TOPK_IDS",
    "TOPK_LOGPROBS",
    "OUTPUT_KEYS",
    "ROLLOUT_SETTINGS",
    "is_topk_mode",
    "configured_topk",
    "check_anchor",
    "divergence_from_extras",
    "unsupported_settings",
    "fused_kernels_problem",
    "configured_fused_kernels_problem",
    "untied_head_fsdp2_problem",
    "pad_to_length_problem",
    "dynamic_cp_problem",
    "FAMILY",
]


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


def configured_topk(config: Any) -> int:
    """K in effect: policy_loss.topk, or the mode's default (`LossMode.default_topk`) when it is unset or None."""
    topk = checked("topk", policy_loss_get(config, "topk", None))
    return mode_named(policy_loss_get(config, "loss_mode")).default_topk if topk is None else topk


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
    statistic = mode_named(mode_name).measure
    value = getattr(extras, f"topk_{statistic}", None) if extras is not None else None
    if value is None:
        raise ValueError(
            f"{mode_name} needs the per-token Top-K statistics that the actor's logits hook computes, but this "
            "micro-batch has none. Either the batch lacks the rollout's top-K fields (set "
            f"{ROLLOUT_SETTINGS}), or the loss was not called through verl's engine with the hook on (the "
            "FSDP or Megatron engine's logits hook, or with use_fused_kernels the fused LM-head pass)"
        )
    if tuple(value.shape) != tuple(valid.shape):
        raise ValueError(f"{mode_name}: Top-K statistics {tuple(value.shape)} vs response {tuple(valid.shape)}")
    # NaN marks a token whose rollout statistics are unusable (the hook's `unusable_rows`): the loss drops it.
    return torch.where(valid, value.detach().float(), torch.zeros_like(value, dtype=torch.float32))


def fused_kernels_problem(mode: str, megatron: bool, backend: Optional[str], remove_padding: bool) -> Optional[str]:
    """Why `use_fused_kernels=True` cannot serve this mode, or None: on the FSDP engine's torch (or liger) backend the
    hook's statistics are computed fused with the LM head (`verl_dppo.patches.fused_lm_head`)."""
    if megatron:
        return (
            f"{mode} with use_fused_kernels on the Megatron engine: verl's fused path there is its Triton "
            "linear_cross_entropy kernel (log-probs and entropy only, which the plugin's pass replaces for the binary "
            "modes and the baselines, not the Top-K statistics): set "
            "actor_rollout_ref.model.use_fused_kernels=False (the logits hook runs) or use the FSDP engine"
        )
    if backend == "triton":
        return (
            f"{mode} with use_fused_kernels: the Triton backend (verl's linear_cross_entropy kernel) returns "
            "log-probs and entropy only; the plugin fuses the Top-K statistics into the torch backend: set "
            "actor_rollout_ref.model.fused_kernel_options.impl_backend=torch"
        )
    if not remove_padding:
        return (
            f"{mode} with use_fused_kernels reads the packed token stream: set "
            "actor_rollout_ref.model.use_remove_padding=True"
        )
    return None


def untied_head_fsdp2_problem(mode: str) -> str:
    """Fused kernels under FSDP2 with an untied LM head: the weight verl's fused forward reads is still sharded (the
    engine refuses it at the first step; `verl-dppo run` before launch when the model's config.json says so)."""
    return (
        f"{mode} with use_fused_kernels: the LM head weight is still sharded where verl's fused forward reads it "
        "(FSDP2 wraps an untied lm_head as its own unit, unsharded only inside lm_head's forward; verl's own fused "
        "kernel fails there too): set actor_rollout_ref.actor.strategy=fsdp, use a model whose LM head is tied to "
        "its embedding, or set actor_rollout_ref.model.use_fused_kernels=False"
    )


def configured_fused_kernels_problem(mode: str, arr: Any) -> Optional[str]:
    """`fused_kernels_problem` for a composed `actor_rollout_ref` section; None when fused kernels are off."""
    if not arr.model.get("use_fused_kernels", False):
        return None
    backend = (arr.model.get("fused_kernel_options", None) or {}).get("impl_backend", "torch")
    return fused_kernels_problem(
        mode, arr.actor.get("strategy") == "megatron", backend, arr.model.get("use_remove_padding", True)
    )


def pad_to_length_problem(mode: str, megatron: bool) -> str:
    engine_key = "actor_rollout_ref.actor.megatron" if megatron else "actor_rollout_ref.actor.fsdp_config"
    return (
        f"{mode}: static packing shifts the logits against the rollout's top-K rows: set "
        f"{engine_key}.pad_to_length=False"
    )


def dynamic_cp_problem(mode: str) -> str:
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
    fused = configured_fused_kernels_problem(mode, arr)
    if fused is not None:
        problems.append(fused)
    if engine.get("pad_to_length", False):
        problems.append(pad_to_length_problem(mode, megatron))
    if megatron and engine.get("dynamic_context_parallel", False):
        problems.append(dynamic_cp_problem(mode))
    from verl_dppo.plugin.rollout_fields import raw_logprobs_problem, truncated_sampling_problem

    for problem in (truncated_sampling_problem(mode, arr.rollout), raw_logprobs_problem(mode, arr.rollout)):
        if problem is not None:
            problems.append(problem)
    return problems


class TopKFamily(LossFamily):
    logits_hook = "topk"

    def options(self, mode: LossMode, config: Any) -> tuple[Any, Any, str]:
        options, _, _ = super().options(mode, config)
        return options, None, options.describe(topk=configured_topk(config))

    def check(self, mode: LossMode, options: Any) -> None:
        check_anchor(mode.name, options.anchor)

    def hook_terms(self, mode: LossMode, extras: Any, options: Any, response: torch.Tensor):
        # D itself is the marker: NaN where the token's rollout statistics are unusable (dropped)
        return None, divergence_from_extras(mode.name, extras, options.anchor, response)

    def divergence(self, tokens: Tokens) -> Optional[torch.Tensor]:
        return tokens.unusable


# K = 20 when policy_loss.topk is unset: the DPPO paper's Top-K ablation.
FAMILY = TopKFamily(
    (
        LossMode(
            "dppo_topk_tv",
            "DPPO-TopK-TV: Eq. (12) with D = Eq. (15)",
            measure="tv",
            paper_delta=0.15,
            default_topk=20,
            label="kTV",
            color="#2ca02c",
        ),
        LossMode(
            "dppo_topk_kl",
            "DPPO-TopK-KL: Eq. (12) with D = Eq. (16)",
            measure="kl",
            paper_delta=0.05,
            default_topk=20,
            label="kKL",
            color="#98df8a",
        ),
    )
)
