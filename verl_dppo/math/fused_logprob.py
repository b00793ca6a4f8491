"""log pi(a_t) and the entropy fused with the LM head, for the modes that need nothing else of the logits (the binary
DPPO modes, the ratio-clip and PG-IS baselines): what verl's `FusedLinearForPPO` returns, from the plugin's one-read
pass (`verl_dppo.math.fused_topk.fused_slot_logprobs` with a_t as the only slot).

Pure torch (no verl import). Per chunk of tokens the logits are formed once and read once: their max, the logit at
a_t and the sum of exp over the rest (on a GPU in one Triton kernel, `kernels.max_and_sum_exp_outside`, as the matmul
left them), and the entropy (`kernels.row_entropy`); the backward recomputes the chunk's logits and forms dL/dlogits
in place (`kernels.scaled_exp_into`). verl's torch kernel computes the same in float32 from a float32 copy of each
chunk's logits, a log-softmax and a second pass for the entropy.
"""

from __future__ import annotations

from typing import Optional

import torch

from verl_dppo.math.fused_topk import DEFAULT_CHUNK_TOKENS, _fixed_selector, fused_slot_logprobs

__all__ = ["fused_token_logprobs"]


def fused_token_logprobs(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0,
                         *, entropy: bool = False,
                         chunk_tokens: int = DEFAULT_CHUNK_TOKENS) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(log pi(labels) [T], the entropy [T] or None) with logits = hidden @ weight^T / temperature, hidden [T, H],
    weight [V, H], labels [T] in [0, V); float32 (float64 for float64 inputs), with exact gradients to hidden and
    weight (each chunk's logits recomputed in the backward)."""
    if labels.dim() != 1 or labels.shape[0] != hidden.shape[0]:
        raise ValueError(f"labels [T={hidden.shape[0]}] expected, got {tuple(labels.shape)}")
    slot_ids = labels.long()[:, None]
    dropped = torch.zeros_like(slot_ids, dtype=torch.bool)
    log_pi, _, ent, _, _, _ = fused_slot_logprobs(hidden, weight, temperature, _fixed_selector(slot_ids, dropped), 1,
                                                  entropy, chunk_tokens)
    out = torch.promote_types(torch.promote_types(hidden.dtype, weight.dtype), torch.float32)
    return log_pi[:, 0].to(out), (ent.to(out) if entropy else None)
