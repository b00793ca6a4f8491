"""Patch of `verl.workers.engine_workers.TrainingWorker.train_batch` (one mini-batch on every rank).

Why a patch: verl 0.9.1 turns the engine's logits hook on only for distillation (`distillation_use_topk`, set by the
trainer from the distillation config), and averages every loss metric over micro-batches with equal weight, which
biases a mean over a condition (`verl_dppo.plugin.metrics`). Neither has an extension point.
What the wrapper does: for a `dppo_topk_*` mode or `troll`, refuse the settings under which the hook cannot run and set
`distillation_use_topk=True` on the mini-batch; after verl has gathered the mini-batch's metrics from every
data-parallel rank, make the plugin's ratio diagnostics exact.
`TrainingWorker.infer_batch` is wrapped to make the worker's loss function known to the engine's no-grad steps
(`fused_lm_head.worker_loss`: the plugin's unfused modes take log-probs from the plugin's pass there too).
`ActorRolloutRefWorker.update_weights` is wrapped to record the pushed weights' version (`global_steps`), which each
mini-batch then carries for the staleness diagnostics (verl_dppo.plugin.staleness).
What would make it unnecessary upstream: the trainer's version in the actor's batch; a per-loss "needs logits" flag
on the loss function (or the worker's config); a ratio-type `AggregationType` (sum of numerators over sum of
denominators) in `verl.utils.metric`.
"""

from __future__ import annotations

import functools
from typing import Any, Optional

from verl_dppo.patches._import_hook import patch_once
from verl_dppo.plugin.modes import logits_hook
from verl_dppo.plugin.options import policy_loss_get, read_key
from verl_dppo.plugin.topk_mode import (
    ROLLOUT_SETTINGS,
    TOPK_IDS,
    TOPK_LOGPROBS,
    dynamic_cp_problem,
    fused_kernels_problem,
    is_topk_mode,
    pad_to_length_problem,
)

__all__ = ["prepare_train_batch", "patch_engine_workers"]


def _topk_loss_mode(loss_fn: Any) -> Optional[str]:
    """The Top-K loss mode a worker's loss function runs, or None for any other loss."""
    if not isinstance(loss_fn, functools.partial):
        return None
    config = loss_fn.keywords.get("config")
    if config is None:
        return None
    mode = policy_loss_get(config, "loss_mode")
    if not is_topk_mode(mode):
        return None
    if "distillation_config" in loss_fn.keywords:
        raise ValueError(f"{mode} cannot run together with distillation (both own the logits hook): disable one")
    return mode


def prepare_train_batch(worker: Any, data: Any) -> None:
    """Turn the engine's logits hook on for a Top-K mode or troll, refusing settings under which it cannot work
    (troll: the Megatron engine too)."""
    mode = _topk_loss_mode(getattr(worker, "loss_fn", None))
    if mode is None:
        return
    from verl.utils import tensordict_utils as tu

    engine_config = getattr(worker, "engine_config", None)
    use_fused = tu.get_non_tensor_data(data, key="use_fused_kernels", default=None)
    if use_fused is None:
        use_fused = getattr(engine_config, "use_fused_kernels", False)
    megatron = getattr(engine_config, "strategy", None) == "megatron"
    if use_fused:  # the hook then runs fused with the LM head (verl_dppo.patches.fused_lm_head), where it can
        model = getattr(worker, "model_config", None)
        backend = (
            (getattr(model, "fused_kernel_options", None) or {}).get("impl_backend", "torch")
            if model is not None
            else "torch"
        )
        problem = fused_kernels_problem(mode, megatron, backend, getattr(engine_config, "use_remove_padding", True))
        if problem is not None:
            raise ValueError(problem)
    if getattr(engine_config, "pad_to_length", False):
        raise ValueError(pad_to_length_problem(mode, megatron))
    if megatron and getattr(engine_config, "dynamic_context_parallel", False):
        raise ValueError(dynamic_cp_problem(mode))
    if megatron:
        from verl_dppo.patches.megatron_logits_hook import LAYOUT_KEY, check_context_parallel_layout, megatron_layout

        check_context_parallel_layout(mode, engine_config, getattr(worker, "engine", None))
        # the split arguments the engine's forward gives the input ids, and the model's own vocabulary
        tu.assign_non_tensor(
            data,
            **{LAYOUT_KEY: megatron_layout(getattr(worker, "engine", None), getattr(worker, "model_config", None))},
        )
    missing = [key for key in (TOPK_IDS, TOPK_LOGPROBS, "rollout_log_probs") if key not in data.keys()]
    if missing:
        raise ValueError(f"{mode} needs {', '.join(missing)} in the training batch: set {ROLLOUT_SETTINGS}")
    if logits_hook(mode) == "troll" and _uses_kl_loss(worker.loss_fn.keywords["config"]):
        _disable_inplace_cross_entropy(mode)
    tu.assign_non_tensor(data, distillation_use_topk=True, distillation_only=False)


def _uses_kl_loss(config: Any) -> bool:
    return bool(read_key(config, "use_kl_loss", False))


def _disable_inplace_cross_entropy(mode: str) -> None:
    """verl's ppo_loss adds its KL loss on verl's own log_prob, whose flash-attn cross entropy (inplace_backward=True
    unless the entropy is computed) writes its gradient into the logits' storage, which TROLL's backward still reads
    (it would raise). `logprobs_from_logits` reads VERL_DISABLE_FLASH_ATTN_CE at each call: its pure-torch path
    leaves the logits alone (at the memory cost of its saved log-softmax)."""
    import logging
    import os

    if os.environ.get("VERL_DISABLE_FLASH_ATTN_CE") != "1":
        os.environ["VERL_DISABLE_FLASH_ATTN_CE"] = "1"
        logging.getLogger("verl_dppo").warning(
            "%s with actor.use_kl_loss=True: VERL_DISABLE_FLASH_ATTN_CE=1 set in this worker, so that the KL loss's "
            "backward through verl's log-probs does not overwrite the logits TROLL's backward reads",
            mode,
        )


def patch_engine_workers(module: Any) -> None:
    """Wrap `TrainingWorker.train_batch` (keeps verl's `@register` metadata through functools.wraps): turn the logits
    hook on for the Top-K modes, and make the mini-batch's ratio diagnostics exact (verl_dppo.plugin.metrics) once verl has
    gathered them from every data-parallel rank, before `train_mini_batch` averages them."""

    def make(original):
        def train_batch(self, data, *args, **kwargs):
            prepare_train_batch(self, data)
            _assign_trainer_version(data)
            output = original(self, data, *args, **kwargs)
            if output is not None:  # the rank that returns the mini-batch's metrics, gathered over the DP group
                from verl.utils import tensordict_utils as tu

                from verl_dppo.plugin.metrics import exact_ratio_metrics

                metrics = tu.get(output, "metrics", default=None)
                if isinstance(metrics, dict):
                    exact_ratio_metrics(metrics)
            return output

        return train_batch

    patch_once(module.TrainingWorker, "train_batch", make)
    patch_once(module.TrainingWorker, "infer_batch", make_infer_batch)
    patch_once(module.ActorRolloutRefWorker, "update_weights", _record_version)


def make_infer_batch(original):
    """`TrainingWorker.infer_batch` with the worker's loss function known to the engine's step
    (`fused_lm_head.worker_loss`): verl passes none for its no-grad passes (compute_loss=False), and the plugin's
    unfused modes take their log-probs there from the plugin's pass as in the update."""

    def infer_batch(self, data, *args, **kwargs):
        from verl_dppo.patches.fused_lm_head import worker_loss

        with worker_loss(getattr(self, "loss_fn", None)):
            return original(self, data, *args, **kwargs)

    return infer_batch


def _assign_trainer_version(data: Any) -> None:
    """The staleness diagnostics' trainer version (verl_dppo.plugin.staleness): the last weight push's label."""
    from verl_dppo.plugin.staleness import TRAINER_VERSION, trainer_version

    version = trainer_version()
    if version is not None and "extra_fields" in data.keys():
        from verl.utils import tensordict_utils as tu

        tu.assign_non_tensor(data, **{TRAINER_VERSION: version})


def _record_version(original):
    """`ActorRolloutRefWorker.update_weights(global_steps=...)`: verl gives the actor worker, on every weight push
    (every trainer mode, `naive` backend included), the version label the rollout records in its replies; the worker
    keeps no copy of it, so the staleness diagnostics record it here."""

    async def update_weights(self, global_steps=None, *args, **kwargs):
        from verl_dppo.plugin.staleness import record_trainer_version

        record_trainer_version(global_steps)
        return await original(self, global_steps, *args, **kwargs)

    return update_weights
