"""The tokens `verl-dppo mismatch` measures, written by the training worker as the loss sees them.

With `VERL_DPPO_MISMATCH_DUMP=DIR` in a training worker's environment (the `mismatch` command sets it in its run's
Ray environment, as does the real-model test), every call of the plugin's `ppo_loss` wrapper for a DPPO mode appends the
micro-batch's response tokens to `DIR/tokens-<pid>-<n>.pt`: mu (the rollout engine's log-prob of each sampled token,
`rollout_log_probs`), pi (the training engine's log-prob of it, from the update's own forward: the pi the trust
region compares with mu), and, for the Top-K modes, the Top-K TV and KL over mu's top-K rows that the engine's logits
hook computed and the mass of mu's top-K row. The command's run makes one update per step on the policy that
sampled, so every call is on the weights vLLM sampled with: pi and mu differ by the two engines alone.
"""

from __future__ import annotations

import itertools
import os
from typing import Any

import torch

__all__ = ["ENV", "dump"]

ENV = "VERL_DPPO_MISMATCH_DUMP"
_COUNTER = itertools.count()


def dump(folder: str, model_output: Any, data: Any, extras: Any) -> None:
    """Append one micro-batch's tokens to `folder` (the value of `ENV`); nothing where it has no rollout log-probs."""
    if extras.rollout_log_probs is None:
        return
    from verl.workers.utils.padding import no_padding_2_padding

    pi = no_padding_2_padding(model_output["log_probs"], data).detach()
    mask = data.select("response_mask").to_padded_tensor()["response_mask"].to(torch.bool)
    # the dtypes the loss reads the rounding of (losses._measure: a bf16 log-prob does not resolve 1 - p below eps)
    record = {
        "mu": extras.rollout_log_probs.float()[mask].cpu(),
        "pi": pi.float()[mask].cpu(),
        "mu_dtype": str(extras.rollout_log_probs.dtype),
        "pi_dtype": str(pi.dtype),
    }
    for name in ("topk_tv", "topk_kl", "topk_mass"):
        value = getattr(extras, name, None)
        if value is not None:
            record[name] = value.detach().float()[mask].cpu()
    os.makedirs(folder, exist_ok=True)
    torch.save(record, os.path.join(folder, f"tokens-{os.getpid()}-{next(_COUNTER)}.pt"))
