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

With fused kernels off (`use_fused_kernels=False`, verl's default) every plugin mode (`DPPO_MODES`; the Top-K modes'
and troll's logits hook runs beside it, as before) takes log pi(a_t) and the entropy from the logits in the plugin's
one-read pass (`verl_dppo.math.logits_logprob`) instead of verl's `entropy_from_logits` (several [nnz, V] tensors)
and `logprobs_from_logits` (without flash-attn a loop row by row, in bf16 for bf16 logits: on a GPU several times
the binary step's time for the Top-K and troll steps, docs/benchmarks.md). `forward_step` marks such a step
the same way (unfused; a no-grad pass without a loss function, such as the old log-probs' recompute, by the
worker's loss: `worker_loss`, opened by `engine_workers` around `TrainingWorker.infer_batch`); while
`prepare_model_outputs` runs for it, the engine's `compute_entropy_from_logits` (the remove-padding branch,
chunked or checkpointed alike) and `verl_F.entropy_from_logits` (the padded branch) compute the entropy with
log pi(labels) in one read when the labels are those of that logits tensor (the remove-padding branch without
entropy checkpointing), and the module's `logprobs_from_logits` then returns that log pi without a second read
(else it reads the logits once itself).
What would make it unnecessary: one call for log-probs and entropy in verl's engine (or a one-read torch path
in `logprobs_from_logits`).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from dataclasses import dataclass
from typing import Any, Optional

import torch

from verl_dppo.patches._import_hook import patch_once
from verl_dppo.plugin.modes import is_topk_mode
from verl_dppo.plugin.options import policy_loss_get
from verl_dppo.plugin.log_once import warn_once

__all__ = ["patch_torch_functional", "patch_fsdp_engine", "patch_engine_logprobs", "worker_loss"]


@dataclass
class _Step:
    config: Any
    data: Any
    outputs: Optional[dict] = None
    fused: bool = True  # False: logits formed by verl (use_fused_kernels off), the plugin's one-read pass on them
    labels: Optional[torch.Tensor] = None  # unfused, while prepare_model_outputs runs: verl's rolled labels
    serving: bool = False  # unfused: prepare_model_outputs is running
    joint: bool = False  # unfused: the entropy may compute log pi(labels) with it (no entropy checkpointing)
    pending: Optional[tuple] = None  # unfused: (logits, labels, log pi) from the entropy's pass


_STEP: contextvars.ContextVar[Optional[_Step]] = contextvars.ContextVar("verl_dppo_fused_step", default=None)
_WORKER_LOSS: contextvars.ContextVar[Any] = contextvars.ContextVar("verl_dppo_worker_loss", default=None)
"""The worker's loss function during `TrainingWorker.infer_batch` (`patches.engine_workers`): verl's no-grad passes
(the old log-probs' recompute) call forward_step without it, and an unfused plugin step is marked from it."""


@contextlib.contextmanager
def worker_loss(loss_fn: Any):
    """While it is open, a forward-only step without a loss function is marked as `loss_fn`'s would be (unfused)."""
    token = _WORKER_LOSS.set(loss_fn)
    try:
        yield
    finally:
        _WORKER_LOSS.reset(token)


def _announce(config: Any) -> None:
    """Once per process and mode, the line a user looks for to know the fused pass runs (as "in effect")."""
    mode = policy_loss_get(config, "loss_mode")
    what = "statistics" if is_topk_mode(mode) else "log-probs and entropy"
    warn_once(
        ("fused", mode),
        "verl-dppo %s: %s fused with the LM head in the plugin's one-read pass "
        "(use_fused_kernels, torch backend): the [tokens, vocabulary] logits are never formed",
        mode,
        what,
    )


def _announce_unfused(config: Any) -> None:
    mode = policy_loss_get(config, "loss_mode")
    warn_once(
        ("unfused", mode),
        "verl-dppo %s: log-probs and entropy from the logits in the plugin's one-read pass "
        "(use_fused_kernels=False) instead of verl's entropy_from_logits and logprobs_from_logits",
        mode,
    )


def _unfused_config(loss_function: Any, micro_batch: Any) -> Any:
    """The actor config of a plugin loss on a step without fused kernels, else None: its log pi(a_t) and entropy come
    from the plugin's pass on the logits (a Top-K / troll loss's logits hook runs beside it, as before)."""
    from verl.utils import tensordict_utils as tu

    from verl_dppo.plugin.extras import DPPO_MODES

    if tu.get_non_tensor_data(micro_batch, key="use_fused_kernels", default=False):
        return None
    if not isinstance(loss_function, functools.partial) or "distillation_config" in loss_function.keywords:
        return None  # verl's own distillation (its hook, its log-probs)
    config = loss_function.keywords.get("config")
    mode = policy_loss_get(config, "loss_mode") if config is not None else None
    return config if mode in DPPO_MODES else None


def _serving_step() -> Optional[_Step]:
    step = _STEP.get()
    return step if step is not None and step.serving else None


def _plugin_entropy(step: _Step, logits: torch.Tensor, chunk_size: Any = None) -> torch.Tensor:
    """The entropy of each row of `logits` ([..., V]) from the plugin's pass (verl's chunk size does not apply:
    the pass chunks by bytes), with log pi(labels) kept for `logprobs_from_logits` when the step's labels are
    those of these rows."""
    from verl_dppo.math import logits_logprob

    labels = step.labels
    if step.joint and labels is not None and logits.dim() == 2 and tuple(labels.shape) == tuple(logits.shape[:1]):
        log_pi, entropy = logits_logprob.logits_logprobs(logits, labels, entropy=True)
        step.pending = (logits, labels, log_pi)
        return entropy
    return logits_logprob.logits_logprobs(logits, entropy=True)[1]


class _EngineTorchFunctional:
    """transformer_impl's `verl_F` (verl.utils.torch_functional): `entropy_from_logits` is the plugin's while an
    unfused plugin step's outputs are formed (verl's padded branch calls it there); every other name is verl's."""

    def __init__(self, module: Any) -> None:
        self._module = module

    def __getattr__(self, name: str) -> Any:
        if name == "entropy_from_logits":
            step = _serving_step()
            if step is not None:
                return functools.partial(_plugin_entropy, step)
        return getattr(self._module, name)


def _unfused_outputs(engine, original, step: _Step, output, output_args, micro_batch, logits_processor_func):
    """verl's `prepare_model_outputs` with the entropy and log pi(labels) from the plugin's pass (the module doc)."""
    step.labels = output_args.get("input_ids_rmpad_rolled")
    step.joint = not engine.engine_config.entropy_checkpointing
    step.serving, step.pending = True, None
    had = "compute_entropy_from_logits" in vars(engine)
    verl_entropy = vars(engine).get("compute_entropy_from_logits")
    engine.compute_entropy_from_logits = functools.partial(_plugin_entropy, step)
    try:
        model_output = original(engine, output, output_args, micro_batch, logits_processor_func)
    finally:
        if had:
            engine.compute_entropy_from_logits = verl_entropy
        else:
            del engine.compute_entropy_from_logits
        step.serving, step.pending, step.labels = False, None, None
    _announce_unfused(step.config)
    return model_output


def patch_engine_logprobs(module: Any) -> None:
    """transformer_impl's `logprobs_from_logits` and `verl_F`: the plugin's pass while an unfused plugin step's
    outputs are formed, verl's otherwise."""

    def make(original):
        def logprobs_from_logits(logits, labels, inplace_backward=True):
            step = _serving_step()
            if step is None:
                return original(logits, labels, inplace_backward=inplace_backward)
            from verl_dppo.math import logits_logprob

            pending, step.pending = step.pending, None
            if pending is not None and pending[0] is logits and pending[1] is labels:
                return pending[2]  # computed with the entropy, from the same read
            return logits_logprob.logits_logprobs(logits, labels)[0]

        return logprobs_from_logits

    patch_once(module, "logprobs_from_logits", make)
    if not isinstance(module.verl_F, _EngineTorchFunctional):
        module.verl_F = _EngineTorchFunctional(module.verl_F)


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
    """`FSDPEngineWithLMHead.forward_step` marks the step; `prepare_model_outputs` stores the fused pass's outputs
    (unfused: forms them with the plugin's pass, `patch_engine_logprobs`)."""
    engine = module.FSDPEngineWithLMHead
    patch_engine_logprobs(module)

    def make_forward_step(original):
        def forward_step(self, micro_batch, loss_function, forward_only):
            config, fused = _topk_config(loss_function, micro_batch), True
            if config is None:  # a no-grad pass (loss_function None): the worker's loss says which mode
                marking = loss_function if loss_function is not None or not forward_only else _WORKER_LOSS.get()
                config, fused = _unfused_config(marking, micro_batch), False
            if config is None:
                return original(self, micro_batch, loss_function, forward_only)
            token = _STEP.set(_Step(config, micro_batch, fused=fused))
            try:
                return original(self, micro_batch, loss_function, forward_only)
            finally:
                _STEP.reset(token)

        return forward_step

    def make_prepare_model_outputs(original):
        def prepare_model_outputs(self, output, output_args, micro_batch, logits_processor_func):
            step = _STEP.get()
            if step is not None and not step.fused:
                return _unfused_outputs(self, original, step, output, output_args, micro_batch, logits_processor_func)
            model_output = original(self, output, output_args, micro_batch, logits_processor_func)
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
