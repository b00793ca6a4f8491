"""What the loss needs beyond the seven arguments verl 0.9.1's `ppo_loss` passes: the micro-batch's rollout
log-probs (mu), the entropy, the Top-K statistics or TROLL's terms from the engine's logits hook.

The `ppo_loss` wrapper (`verl_dppo.patches.workers_utils_losses`) fills a `BatchExtras` per micro-batch and binds it
for the duration of the loss call; the loss (`verl_dppo.plugin.losses`) reads it with `current_extras()`.
"""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass
from typing import Iterator, Optional

import torch

__all__ = ["BatchExtras", "DPPO_MODES", "bind_extras", "current_extras"]


DPPO_MODES: set[str] = set()
"""Loss modes whose functions read the extras; filled by `verl_dppo.plugin.losses.register_all`."""


@dataclass
class BatchExtras:
    """Per-micro-batch tensors aligned with `old_log_probs` ([batch, response_len], padded like it)."""

    rollout_log_probs: Optional[torch.Tensor] = None
    entropy: Optional[torch.Tensor] = None
    topk_tv: Optional[torch.Tensor] = None
    """Top-K D_TV (Eq. 15) per token, from the actor's logits hook (patches.fsdp_logits_hook); Top-K modes only."""
    topk_kl: Optional[torch.Tensor] = None
    """Top-K D_KL (Eq. 16) per token, from the same hook."""
    troll: Optional[dict[str, torch.Tensor]] = None
    """troll mode: TROLL's per-token terms from the same hook, keyed as `troll_mode.OUTPUT_KEYS` (log_p, regression_kl,
    log_mu, valid, projected, eta, kl_before, kl_after, support_size); log_p and regression_kl keep their gradient."""
    topk_mass: Optional[torch.Tensor] = None
    """The probability mass of the rollout's top-K row per token, sum_k mu(v_k) (the rows as the rollout engine sent
    them), when the micro-batch carries them: actor/*/rollout_topk_mass_mean shows in the log that they came."""
    lags: Optional[torch.Tensor] = None
    """Per-sample lag [batch] (trainer version - oldest version that sampled the response; NaN: unknown), when the
    batch carries version information (`verl_dppo.plugin.staleness`)."""
    ratio_parts: Optional[dict] = None
    """Filled by the loss: each mean-type diagnostic as (numerator, denominator), for exact aggregation."""


_EXTRAS: contextvars.ContextVar[Optional[BatchExtras]] = contextvars.ContextVar("verl_dppo_extras", default=None)


def current_extras() -> Optional[BatchExtras]:
    """The extras of the micro-batch whose loss is being computed, or None outside the wrapped `ppo_loss`."""
    return _EXTRAS.get()


@contextlib.contextmanager
def bind_extras(extras: BatchExtras) -> Iterator[BatchExtras]:
    """Make `extras` what `current_extras()` returns inside the block (one loss call)."""
    token = _EXTRAS.set(extras)
    try:
        yield extras
    finally:
        _EXTRAS.reset(token)
