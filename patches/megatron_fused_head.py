"""The binary DPPO modes and the baselines (ratio-clip, PG-IS) under `actor_rollout_ref.model.use_fused_kernels=True`
on verl 0.9.1's Megatron engine: log pi(a_t) and the entropy from the plugin's fused pass over Megatron's
vocabulary-parallel LM head (`verl_dppo.math.fused_logprob.vocab_parallel_token_logprobs`) instead of verl's Triton
`linear_cross_entropy` kernel.

Which verl methods: with fused kernels the engine's `MegatronEngineWithLMHead.forward_step` calls
`models.mcore.model_forward_fused`'s forward (its `_fused_GPTModel_forward`, or `fused_output_processor` on
megatron-core >= 0.18), which calls that module's `linear_cross_entropy(hidden, weight, labels, temperature, "none",
tp_group)` on each tensor-parallel rank's [V / tp, H] shard of the output layer. Two wrappers:
- `MegatronEngineWithLMHead.forward_step`: with fused kernels on and a loss function of one of the plugin's modes
  that are not Top-K / troll (those refuse Megatron's fused kernels: `topk_mode.fused_kernels_problem`), mark the
  micro-batch for the duration of the step (a context variable); a no-grad pass without a loss function (the old
  log-probs' recompute) is marked by the worker's loss (`fused_lm_head.worker_loss`), as on FSDP;
- `model_forward_fused.linear_cross_entropy` (the module's own name for verl's kernel): while a step is marked,
  the plugin's pass (the shard's first id: the rank in the group times the shard's rows, Megatron's layout); the
  entropy only where the micro-batch asks for it (`calculate_entropy`; else zeros, which verl does not read).
  dh: this rank's share when the hidden states came through Megatron's sequence-parallel all-gather (its backward
  reduce-scatters the shares, as for verl's kernel), else summed over the group (the whole gradient, which each
  rank's replicated hidden states need: Megatron's own output layer all-reduces it there).
Every other call (verl's own loss modes, the Top-K modes, critics) goes to verl's kernel unchanged. Not replaced:
`models.mcore.model_forward_1f1b_overlap` (its own import of the kernel; nothing in verl 0.9.1 calls its
`gptmodel_forward_1f1b_overlap`, so no step reaches it). Megatron's padded vocabulary rows stay in
the normaliser, as in verl's kernel.
Why no extension point: verl calls its kernel by name, with no choice of implementation. What would make it
unnecessary: a configurable log-prob / entropy function in verl's fused forward.
"""

from __future__ import annotations

import contextvars
import functools
from dataclasses import dataclass
from typing import Any, Optional

import torch

from verl_dppo.patches._import_hook import patch_once
from verl_dppo.plugin.log_once import warn_once
from verl_dppo.plugin.modes import is_topk_mode
from verl_dppo.plugin.options import policy_loss_get

__all__ = ["patch_megatron_engine", "patch_model_forward_fused"]


@dataclass
class _Step:
    config: Any
    batch: Any = None  # the micro-batch, once the engine's forward_step has taken it from the iterator


_STEP: contextvars.ContextVar[Optional[_Step]] = contextvars.ContextVar("verl_dppo_megatron_fused", default=None)


def _plugin_config(loss_function: Any) -> Any:
    """The actor config of a plugin loss served here (binary DPPO, the baselines), else None."""
    from verl_dppo.plugin.extras import DPPO_MODES

    if not isinstance(loss_function, functools.partial) or "distillation_config" in loss_function.keywords:
        return None
    config = loss_function.keywords.get("config")
    mode = policy_loss_get(config, "loss_mode") if config is not None else None
    return config if mode in DPPO_MODES and not is_topk_mode(mode) else None


class _Taken:
    """The engine's micro-batch iterator, keeping the batch the step takes."""

    def __init__(self, batches, step: _Step) -> None:
        self._batches, self._step = batches, step

    def __iter__(self):
        return self

    def __next__(self):
        self._step.batch = next(self._batches)
        return self._step.batch


def _forward_step_wrapper(original):
    def forward_step(self, batch_iter, model, logits_processor_func, postprocess_micro_batch_func):
        config = None
        if getattr(getattr(self, "engine_config", None), "use_fused_kernels", False):
            from verl_dppo.patches.fused_lm_head import _WORKER_LOSS

            config = _plugin_config(logits_processor_func if logits_processor_func is not None else _WORKER_LOSS.get())
        if config is None:
            return original(self, batch_iter, model, logits_processor_func, postprocess_micro_batch_func)
        step = _Step(config)
        token = _STEP.set(step)
        try:
            return original(self, _Taken(batch_iter, step), model, logits_processor_func, postprocess_micro_batch_func)
        finally:
            _STEP.reset(token)

    return forward_step


def _through_sequence_parallel_gather(hidden: torch.Tensor) -> bool:
    grad_fn = getattr(hidden, "grad_fn", None)
    return grad_fn is not None and type(grad_fn).__name__ == "_GatherFromSequenceParallelRegionBackward"


def plugin_linear_cross_entropy(step: _Step, hidden, weight, labels, temperature, group):
    """What verl's `linear_cross_entropy(..., reduction="none", group)` returns (log pi(labels), the entropy: float32
    [tokens], tokens in verl's flattening of hidden and labels), from the plugin's vocabulary-parallel pass."""
    import torch.distributed as dist

    from verl.utils import tensordict_utils as tu

    from verl_dppo.math.fused_logprob import vocab_parallel_token_logprobs

    parallel = group is not None and dist.get_world_size(group) > 1
    vocab_start = dist.get_rank(group) * weight.shape[0] if parallel else 0
    entropy = step.batch is None or bool(tu.get_non_tensor_data(step.batch, key="calculate_entropy", default=False))
    log_p, ent = vocab_parallel_token_logprobs(
        hidden.reshape(-1, hidden.shape[-1]),
        weight,
        labels.reshape(-1),
        vocab_start,
        float(temperature),
        group if parallel else None,
        entropy=entropy,
        reduce_grad_hidden=not _through_sequence_parallel_gather(hidden),
    )
    mode = policy_loss_get(step.config, "loss_mode")
    warn_once(
        ("megatron_fused", mode),
        "verl-dppo %s: log-probs and entropy fused with Megatron's vocabulary-parallel "
        "LM head in the plugin's pass (use_fused_kernels) instead of verl's linear_cross_entropy kernel",
        mode,
    )
    return log_p.float(), (ent.float() if ent is not None else torch.zeros_like(log_p, dtype=torch.float32))


def _linear_cross_entropy_wrapper(original):
    def linear_cross_entropy(hidden, weight, labels, temperature=1.0, reduction="none", dist_process_group=None):
        step = _STEP.get()
        if step is None or reduction != "none":
            return original(hidden, weight, labels, temperature, reduction, dist_process_group)
        return plugin_linear_cross_entropy(step, hidden, weight, labels, temperature, dist_process_group)

    return linear_cross_entropy


def patch_megatron_engine(module: Any) -> None:
    """verl.workers.engine.megatron.transformer_impl: `MegatronEngineWithLMHead.forward_step` marks the step."""
    patch_once(module.MegatronEngineWithLMHead, "forward_step", _forward_step_wrapper)


def patch_model_forward_fused(module: Any) -> None:
    """verl.models.mcore.model_forward_fused: its `linear_cross_entropy` takes the plugin's pass for a marked step."""
    patch_once(module, "linear_cross_entropy", _linear_cross_entropy_wrapper)
