"""Patch of `verl.workers.utils.losses.ppo_loss`: hand the DPPO losses the rollout engine's log-probs mu.

Which verl function: `ppo_loss(config, model_output, data, dp_group)` calls a registered policy loss with
`old_log_prob` only; `rollout_log_probs` sits in the micro-batch unused. At plugin load we wrap `ppo_loss`: for a
DPPO loss mode the wrapper pads the micro-batch's `rollout_log_probs` (and the model's entropy, and the Top-K
statistics or TROLL's terms of the logits hook) exactly as `ppo_loss` pads `old_log_probs`, binds them for the duration of the call
(`verl_dppo.plugin.extras`), and turns the loss's mean-type diagnostics into exact `RatioMetric`s. A call with
`student_logits=` (the engine's logits hook, on for the Top-K modes and troll only) goes to `fsdp_logits_hook` /
`megatron_logits_hook`. For every other loss mode the wrapper is a plain pass-through.
Why no extension point: verl 0.9.1's `PolicyLossFn` signature has no slot for the rollout log-probs (its type alias
names a 7th argument `rollout_log_probs` that `ppo_loss` never passes).
What would make it unnecessary: `ppo_loss` passing `rollout_log_probs=data.get("rollout_log_probs")` (and the
entropy) to the policy loss, as its own type alias promises.

`engine_workers` and `trainer.distillation.losses` import `ppo_loss` by name at their own import, which happens
after `import verl` has loaded this plugin, so they pick up the wrapper. Modules already imported are re-pointed.
"""

from __future__ import annotations

import functools
import os
import sys
from typing import Any, Callable, Optional

import torch

from verl_dppo.plugin import mismatch_dump
from verl_dppo.plugin.moe import router_replay
from verl_dppo.plugin.extras import DPPO_MODES, BatchExtras, bind_extras
from verl_dppo.plugin.metrics import finalize_metrics, ratios
from verl_dppo.plugin.staleness import sample_lags

__all__ = ["install", "is_installed"]

# Modules that bind `ppo_loss` by name (`from verl.workers.utils.losses import ppo_loss`).
_BY_NAME_IMPORTERS = ("verl.workers.engine_workers", "verl.trainer.distillation.losses")

_WRAPPED_MARK = "__verl_dppo_wrapped__"


class _Padding:
    """verl's `no_padding_2_padding` for every field the wrapper binds, from one layout of the micro-batch.

    verl's function reads the lengths back for each field it pads and slices each sequence with them: 3 + 2B host
    waits a field for B sequences (on a GPU each one stops the host until the device has caught up). The wrapper
    pads the entropy, the Top-K statistics or TROLL's nine terms, and the rollout's top-K mass: here the response
    rows' positions are computed once, with one host read for the micro-batch, and each field is one gather. The
    values are verl's (the same rows, zeros after each response, the same length); gradients flow as through
    verl's slices."""

    def __init__(self, data: Any, nested_rows: Optional[torch.Tensor] = None):
        from verl.utils import tensordict_utils as tu

        prompts, responses = data["prompts"], data["responses"]
        if prompts.is_nested:
            prompt_lens, response_lens = prompts.offsets().diff(), responses.offsets().diff()
            length = tu.get_non_tensor_data(data=data, key="max_response_len", default=-1)
        else:  # verl's padded branch: the lengths from the attention mask, the responses' padded width
            attention_mask = data["attention_mask"]
            prompt_lens = attention_mask[:, : prompts.shape[1]].sum(dim=1)
            response_lens = attention_mask[:, prompts.shape[1] :].sum(dim=1)
            length = responses.shape[1]
        ends = (prompt_lens + response_lens).cumsum(dim=0)
        reads = [ends[-1], (prompt_lens == 0).sum(), response_lens.max()]
        rows_lens = nested_rows.offsets().diff() if nested_rows is not None else None
        if rows_lens is not None:
            reads.append(rows_lens.max())
        values = torch.stack([r.long().to(ends.device) for r in reads]).tolist()  # the one host read
        self.nnz, empty_prompts = values[0], values[1]
        if empty_prompts:
            raise ValueError(f"{empty_prompts} samples have an empty prompt; verl's padding needs a prompt token")
        self.response = self._layout(ends - response_lens - 1, response_lens, values[2] if length < 0 else length)
        self.rows = None
        if rows_lens is not None:
            self.rows = self._layout(nested_rows.offsets()[:-1], rows_lens, values[3])

    @staticmethod
    def _layout(starts: torch.Tensor, lens: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        steps = torch.arange(length, device=lens.device)
        keep = steps[None, :] < lens[:, None]
        return torch.where(keep, starts[:, None].long() + steps[None, :], 0), keep

    @staticmethod
    def _gather(values: torch.Tensor, layout: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        index, keep = layout
        keep = keep.to(values.device).view(*keep.shape, *(1,) * (values.dim() - 1))
        return values[index.to(values.device)].masked_fill(~keep, 0)

    def __call__(self, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` (packed: the logits' stream, nested or flat) as [B, response length, ...], as verl pads it."""
        values = tensor.values() if tensor.is_nested else tensor
        if values.shape[0] != self.nnz:
            raise ValueError(f"a model output of {values.shape[0]} packed rows for a micro-batch of {self.nnz}")
        return self._gather(values, self.response)

    def rows_mass(self, rows: torch.Tensor) -> torch.Tensor:
        """The rollout's top-K mass per response token, [B, response length] (`rows`: nested, one row a token)."""
        return self._gather(rows.values().float().exp().sum(-1), self.rows)


def _extract(model_output: Any, data: Any) -> BatchExtras:
    from verl_dppo.plugin import troll_mode
    from verl_dppo.plugin.topk_mode import OUTPUT_KEYS, TOPK_LOGPROBS

    extras = BatchExtras()
    if "rollout_log_probs" in data.keys():
        # Same select + to_padded_tensor that ppo_loss applies to old_log_probs, so the shapes line up.
        extras.rollout_log_probs = data.select("rollout_log_probs").to_padded_tensor()["rollout_log_probs"]
    get = model_output.get if hasattr(model_output, "get") else (lambda key, default=None: default)
    outputs = {key: get(key, None) for key in ("entropy", *OUTPUT_KEYS.values(), *troll_mode.OUTPUT_KEYS.values())}
    outputs = {key: value for key, value in outputs.items() if value is not None}
    rows = data[TOPK_LOGPROBS] if TOPK_LOGPROBS in data.keys() and data[TOPK_LOGPROBS].is_nested else None
    pad = _Padding(data, rows) if outputs or rows is not None else None
    if "entropy" in outputs:
        extras.entropy = pad(outputs["entropy"]).detach()
    for statistic, key in OUTPUT_KEYS.items():
        if key in outputs:
            setattr(extras, f"topk_{statistic}", pad(outputs[key]).detach())
    troll = {}
    for term, key in troll_mode.OUTPUT_KEYS.items():
        if key in outputs:
            # log p(a_t) and the regression KL keep their graph: TROLL's gradient reaches the logits through them.
            padded = pad(outputs[key])
            troll[term] = padded if term in troll_mode.DIFFERENTIABLE else padded.detach()
    extras.troll = troll or None
    if rows is not None:
        extras.topk_mass = pad.rows_mass(rows)  # padded like old_log_probs
    extras.lags = sample_lags(data)
    return extras


def _wrap(original: Callable) -> Callable:
    @functools.wraps(original)
    def ppo_loss(config, model_output=None, data=None, dp_group=None, student_logits=None, data_format=None):
        loss_mode = config.policy_loss.get("loss_mode", "vanilla")
        if student_logits is not None:
            # The engine's logits hook (`distillation_use_topk`), turned on for dppo_topk_* and troll only; Megatron's
            # engine also passes data_format ("thd" / "bshd") with its vocabulary-parallel logits.
            from verl_dppo.patches.fsdp_logits_hook import logits_processor

            return logits_processor(config, student_logits, data, data_format=data_format)
        if loss_mode not in DPPO_MODES:
            return original(config, model_output, data, dp_group)
        with bind_extras(_extract(model_output, data)) as extras:
            loss, metrics = original(config, model_output, data, dp_group)
        # What follows is off in a plain run (the reader of a loss mode can skip it): the tokens `verl-dppo mismatch`
        # measures, written where its environment variable names a folder, and R3's counts on the FSDP engine, there
        # when the routers of this micro-batch's forward were armed to replay the rollout's routes.
        folder = os.environ.get(mismatch_dump.ENV)
        if folder:
            mismatch_dump.dump(folder, model_output, data, extras)
        replay = router_replay.ratio_parts() if router_replay.ARMED[0] else {}
        metrics.update(ratios(replay))
        return loss, finalize_metrics(metrics, {**(extras.ratio_parts or {}), **replay})

    setattr(ppo_loss, _WRAPPED_MARK, True)
    ppo_loss.__wrapped__ = original
    return ppo_loss


def is_installed() -> bool:
    """True when `verl.workers.utils.losses.ppo_loss` (and every by-name import of it) is our wrapper, as a process
    that imports verl's losses module (every training worker) finds it: the plugin wraps it at that import."""
    import verl.workers.utils.losses as losses

    if not getattr(losses.ppo_loss, _WRAPPED_MARK, False):
        return False
    return all(
        getattr(sys.modules[name], "ppo_loss", losses.ppo_loss) is losses.ppo_loss
        for name in _BY_NAME_IMPORTERS
        if name in sys.modules
    )


def install() -> None:
    """Install the wrapper around verl's `ppo_loss` (idempotent)."""
    import verl.workers.utils.losses as losses

    if not getattr(losses.ppo_loss, _WRAPPED_MARK, False):
        original = losses.ppo_loss
        losses.ppo_loss = _wrap(original)
    else:
        original = losses.ppo_loss.__wrapped__
    for name in _BY_NAME_IMPORTERS:
        module = sys.modules.get(name)
        if module is not None and getattr(module, "ppo_loss", None) is original:
            module.ppo_loss = losses.ppo_loss
