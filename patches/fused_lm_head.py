"""The Top-K modes and troll under `actor_rollout_ref.model.use_fused_kernels=True` on verl 0.9.1's FSDP engine: the
logits hook's statistics fused with the LM head, so that the [nnz, V] logits never exist.

Which verl methods: with fused kernels verl replaces the model's forward (`models.transformers.dense_common` and the
VL variants: `forward_with_torch_backend`), which calls `FusedLinearForPPO.forward(hidden_states, lm_head.weight,
labels, temperature)` (`utils.experimental.torch_functional`) for log pi(labels) and the entropy, chunk by chunk;
`FSDPEngineWithLMHead.prepare_model_outputs` then never calls the logits hook (it has no logits). Three wrappers:
- `FSDPEngineWithLMHead.forward_step`: for a micro-batch with the hook on (`distillation_use_topk`, set by
  `engine_workers` for the Top-K modes and troll) under fused kernels, and a loss function of those modes, mark the
  micro-batch for the duration of the step (a context variable: one forward per step and thread);
- `FusedLinearForPPO.forward`: while a step is marked, compute log pi(labels), the entropy and the hook's outputs in
  one fused pass (`fsdp_logits_hook.fused_lm_head_outputs`: `verl_dppo.math.fused_topk` / `fused_troll`), keep
  the outputs for the step and return what verl's own kernel returns;
- `FSDPEngineWithLMHead.prepare_model_outputs`: put those outputs into `model_output` exactly as verl stores the
  hook's (gathered across Ulysses sequence parallelism, the packing pad stripped, jagged per sequence).
Every other call goes to verl unchanged. The Triton backend (`fused_kernel_options.impl_backend=triton`) calls verl's
`linear_cross_entropy` kernel instead, which this does not replace; `topk_mode.fused_kernels_problem` refuses it.
Why no extension point: verl's fused kernels return log-probs and entropy only and take no extra statistics.
What would make it unnecessary: a hook in `FusedLinearForPPO` that sees each chunk's logits (or a fused top-K
output beside log-probs and entropy).
"""

from __future__ import annotations

import contextvars
import functools
from dataclasses import dataclass
from typing import Any, Optional

import torch

from verl_dppo.patches._import_hook import patch_once
from verl_dppo.plugin.topk_mode import is_topk_mode, policy_loss_get
from verl_dppo.plugin.log_once import warn_once

__all__ = ["patch_torch_functional", "patch_fsdp_engine"]


@dataclass
class _Step:
    config: Any
    data: Any
    outputs: Optional[dict] = None


_STEP: contextvars.ContextVar[Optional[_Step]] = contextvars.ContextVar("verl_dppo_fused_step", default=None)


def _announce(config: Any) -> None:
    """Once per process and mode, the line a user looks for to know the fused pass runs (as "in effect")."""
    mode = policy_loss_get(config, "loss_mode")
    what = "statistics" if is_topk_mode(mode) else "log-probs and entropy"
    warn_once(("fused", mode), "verl-dppo %s: %s fused with the LM head in the plugin's one-read pass "
              "(use_fused_kernels, torch backend): the [tokens, vocabulary] logits are never formed", mode, what)


def _topk_config(loss_function: Any, micro_batch: Any) -> Any:
    """The actor config of a plugin loss whose step the plugin's fused pass serves, else None: a Top-K / troll loss
    whose hook must run in it, or another of the plugin's modes (binary DPPO, the ratio-clip and PG-IS baselines),
    which take log pi(a_t) and the entropy from it instead of verl's kernel."""
    from verl.utils import tensordict_utils as tu

    from verl_dppo.plugin.extras import DPPO_MODES

    if not tu.get_non_tensor_data(micro_batch, key="use_fused_kernels", default=False):
        return None
    if not isinstance(loss_function, functools.partial) or "distillation_config" in loss_function.keywords:
        return None  # verl's own distillation: its hook, not ours
    config = loss_function.keywords.get("config")
    mode = policy_loss_get(config, "loss_mode") if config is not None else None
    if is_topk_mode(mode):
        return config if tu.get_non_tensor_data(micro_batch, key="distillation_use_topk", default=False) else None
    return config if mode in DPPO_MODES else None


def _hooked_output(output: Any) -> Any:
    """A tensor of the model's own output that carries FSDP's pre-backward hook (log pi(labels), else the
    entropy), or None."""
    for name in ("log_probs", "entropy"):
        value = getattr(output, name, None)
        if value is not None and getattr(value, "requires_grad", False):
            return value
    return None


class _ThroughModelOutput(torch.autograd.Function):
    """value -> value, with a zero gradient to `anchor`, a tensor of the model's output.

    Why: FSDP unshards the root module's parameters (the tied LM head among them) for the backward in a hook on the
    model's output tensors: FSDP2 under verl's reshard_after_forward=True, which torch applies to the root too, freed
    them after the forward; FSDP1's root queues its post-backward callback in that hook. TROLL's loss reaches the
    fused pass only through the terms kept beside the model's output (its gradient never flows through verl's
    log_prob), so the hook never fired and the fused backward read freed storage. The zero gradient costs one
    [1, nnz] tensor; the values and gradients of `value` are unchanged."""

    @staticmethod
    def forward(ctx, value, anchor):
        ctx.anchor_meta = (anchor.shape, anchor.dtype, anchor.device)
        return value.clone()

    @staticmethod
    def backward(ctx, grad):
        shape, dtype, device = ctx.anchor_meta
        return grad, torch.zeros(shape, dtype=dtype, device=device)


def _token_logprobs(hidden_states, weight, labels, temperature: float, entropy: bool):
    """What verl's `FusedLinearForPPO.forward` returns (log pi(labels) float32, the entropy, shaped like `labels`;
    the entropy 0 unless asked), from the plugin's one-read pass (`verl_dppo.math.fused_logprob`)."""
    from verl_dppo.math.fused_logprob import fused_token_logprobs

    hidden = hidden_states.reshape(-1, hidden_states.shape[-1])
    log_p, ent = fused_token_logprobs(hidden, weight, labels.reshape(-1), temperature, entropy=entropy)
    ent = ent if ent is not None else torch.zeros_like(log_p)
    return log_p.float().view(labels.shape), ent.view(labels.shape)


def patch_torch_functional(module: Any) -> None:
    """`FusedLinearForPPO.forward`: the marked step's fused Top-K pass (verl's kernel for everything else)."""

    def make(original):
        def forward(self, hidden_states, vocab_weights, input_ids, temperature=1.0):
            step = _STEP.get()
            if step is None or step.outputs is not None:
                return original(self, hidden_states, vocab_weights, input_ids, temperature)
            from verl.utils import tensordict_utils as tu

            from verl_dppo.patches.fsdp_logits_hook import fused_lm_head_outputs

            entropy = bool(tu.get_non_tensor_data(step.data, key="calculate_entropy", default=False))
            if not is_topk_mode(policy_loss_get(step.config, "loss_mode")):
                if isinstance(vocab_weights, torch.distributed.tensor.DTensor):  # an untied head under FSDP2:
                    step.outputs = {}  # verl's kernel, as before (it stops there too: topk_mode.untied_head_...)
                    return original(self, hidden_states, vocab_weights, input_ids, temperature)
                log_probs, ent = _token_logprobs(hidden_states, vocab_weights, input_ids, float(temperature), entropy)
                step.outputs = {}
                _announce(step.config)
                return log_probs, ent
            log_probs, ent, step.outputs = fused_lm_head_outputs(
                step.config, hidden_states, vocab_weights, input_ids, float(temperature), step.data, entropy
            )
            _announce(step.config)
            return log_probs, ent

        return forward

    patch_once(module.FusedLinearForPPO, "forward", make)


def patch_fsdp_engine(module: Any) -> None:
    """`FSDPEngineWithLMHead.forward_step` marks the step; `prepare_model_outputs` stores the fused pass's outputs."""
    engine = module.FSDPEngineWithLMHead

    def make_forward_step(original):
        def forward_step(self, micro_batch, loss_function, forward_only):
            config = _topk_config(loss_function, micro_batch)
            if config is None:
                return original(self, micro_batch, loss_function, forward_only)
            token = _STEP.set(_Step(config, micro_batch))
            try:
                return original(self, micro_batch, loss_function, forward_only)
            finally:
                _STEP.reset(token)

        return forward_step

    def make_prepare_model_outputs(original):
        def prepare_model_outputs(self, output, output_args, micro_batch, logits_processor_func):
            model_output = original(self, output, output_args, micro_batch, logits_processor_func)
            step = _STEP.get()
            if step is None:
                return model_output
            if step.outputs is None:
                raise RuntimeError(
                    "the Top-K statistics were not computed: the model's fused forward did not call verl's "
                    "FusedLinearForPPO (set actor_rollout_ref.model.fused_kernel_options.impl_backend=torch)"
                )
            # As verl stores the logits hook's outputs (prepare_model_outputs, remove-padding branch).
            cu_seqlens = micro_batch["input_ids"].offsets()
            anchor = _hooked_output(output)
            for key, value in step.outputs.items():
                if anchor is not None and value.requires_grad:
                    value = _ThroughModelOutput.apply(value, anchor)
                value = self._gather_and_unpad_packed(value.squeeze(0), output_args["pad_size"])
                model_output[key] = torch.nested.nested_tensor_from_jagged(value, cu_seqlens)
            return model_output

        return prepare_model_outputs

    patch_once(engine, "forward_step", make_forward_step)
    patch_once(engine, "prepare_model_outputs", make_prepare_model_outputs)
