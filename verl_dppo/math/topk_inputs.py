"""The rollout's top-K rows and the learner's logits, checked before any Top-K statistic is computed (shared by the
Top-K DPPO modes and TROLL). Part of `verl_dppo.math.topk`, which re-exports `TopKInputError`, `check_topk_inputs`
and `MASS_TOLERANCE`."""

from __future__ import annotations

import torch

__all__ = ["MASS_TOLERANCE", "TopKInputError", "check_topk_inputs"]

MASS_TOLERANCE = 1e-3
"""mu's kept mass may exceed 1 by this much (rounding in the engine's log-softmax); more is an error."""

class TopKInputError(ValueError):
    """The rollout's top-K statistics are malformed (duplicates, ids outside the vocabulary, mass > 1)."""


def check_topk_inputs(logits, topk_ids, topk_logprobs, sampled_ids, sampled_logprobs, mask,
                      error: type[Exception] = TopKInputError) -> None:
    """The shapes and dtypes of a learner's logits and the rollout's top-K rows (shared with TROLL, which raises its
    own `error`)."""
    if logits.dim() != 2 or not logits.is_floating_point():
        raise error(f"logits must be a float [N, V] tensor, got {tuple(logits.shape)} {logits.dtype}")
    n = logits.shape[0]
    if topk_ids.dim() != 2 or topk_ids.shape[0] != n or topk_ids.shape[1] < 1:
        raise error(f"rollout_topk_ids must be [N={n}, K>=1], got {tuple(topk_ids.shape)}")
    if tuple(topk_logprobs.shape) != tuple(topk_ids.shape):
        raise error(
            f"rollout_topk_logprobs {tuple(topk_logprobs.shape)} must match rollout_topk_ids {tuple(topk_ids.shape)}"
        )
    for name, t in (("sampled_ids", sampled_ids), ("rollout_sampled_logprobs", sampled_logprobs)):
        if tuple(t.shape) != (n,):
            raise error(f"{name} must be [N={n}], got {tuple(t.shape)}")
    if topk_ids.is_floating_point() or sampled_ids.is_floating_point():
        raise error("token ids must be integer tensors")
    if not (topk_logprobs.is_floating_point() and sampled_logprobs.is_floating_point()):
        raise error("log-probs must be float tensors")
    if mask is not None and tuple(mask.shape) != (n,):
        raise error(f"mask must be [N={n}], got {tuple(mask.shape)}")


def _validate_rows(topk_ids: torch.Tensor, sampled_ids: torch.Tensor, vocab_size: int) -> None:
    bad_range = (topk_ids < 0) | (topk_ids >= vocab_size)
    if bool(bad_range.any()) or bool(((sampled_ids < 0) | (sampled_ids >= vocab_size)).any()):
        raise TopKInputError(
            f"top-K or sampled token ids outside the vocabulary [0, {vocab_size}): the rollout engine and the actor "
            "use different vocabularies (check actor_rollout_ref.model.path and the tokenizer)"
        )
    if topk_ids.shape[1] > 1:
        ordered = topk_ids.sort(dim=1).values
        duplicate_rows = (ordered[:, 1:] == ordered[:, :-1]).any(dim=1)
        if bool(duplicate_rows.any()):
            raise TopKInputError(
                f"{int(duplicate_rows.sum())} rows of rollout_topk_ids repeat a token id: the rollout's top-K "
                "extraction is broken (each row must hold K distinct ids)"
            )
