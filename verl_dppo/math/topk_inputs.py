"""The rollout's top-K rows and the learner's logits, checked before any Top-K statistic is computed (shared by the
Top-K DPPO modes and TROLL). Part of `verl_dppo.math.topk`, which re-exports `TopKInputError`, `check_topk_inputs`
and `MASS_TOLERANCE`."""

from __future__ import annotations

import math
from typing import Callable, Optional, Sequence

import torch

__all__ = ["MASS_TOLERANCE", "TopKInputError", "check_topk_inputs", "raise_first", "row_problems", "mu_problems"]

MASS_TOLERANCE = 1e-3
"""mu's kept mass may exceed 1 by this much (rounding in the engine's log-softmax); more is an error."""


class TopKInputError(ValueError):
    """The rollout's top-K statistics are malformed (duplicates, ids outside the vocabulary, mass > 1)."""


def check_topk_inputs(
    logits, topk_ids, topk_logprobs, sampled_ids, sampled_logprobs, mask, error: type[Exception] = TopKInputError
) -> None:
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


Problem = tuple[torch.Tensor, Callable[[Optional[torch.Tensor]], None]]
"""(a bool [N] tensor, True at a row whose input is wrong; a function raising the error that names the problem,
given the mask of rows checked or None for all: called on the error path only, where its details may wait)."""


def raise_first(problems: Sequence[Problem], keep: Optional[torch.Tensor] = None) -> int:
    """Reads every problem's flag and the number of rows `keep` selects back to the host in ONE transfer (a call's
    only wait for the device: issue 54.2), raises the first problem found among the kept rows, in the order given;
    returns how many rows `keep` selects (N without it). Flags of different lengths (the fused path checks every a_t
    but the top-K of the kept rows only) are reduced one by one, and need keep=None."""
    if keep is not None or len({rows.shape for rows, _ in problems}) == 1:
        flags = torch.stack([rows for rows, _ in problems], dim=1)
        found = (flags if keep is None else flags & keep[:, None]).any(dim=0)
    else:
        found = torch.stack([rows.any() for rows, _ in problems])
    read = found.long() if keep is None else torch.cat([found.long(), keep.sum().reshape(1)])
    values = read.tolist()  # the wait
    for hit, (_, fail) in zip(values, problems):
        if hit:
            fail(keep)
    return values[-1] if keep is not None else len(problems[0][0])


def row_problems(topk_ids: torch.Tensor, sampled_ids: torch.Tensor, vocab_size: int) -> list[Problem]:
    """Top-K or sampled ids outside [0, vocab_size), then a top-K row repeating an id: per row, on the device (no
    wait). `sampled_ids` may hold other rows than `topk_ids` (see `raise_first`)."""
    outside = ((topk_ids < 0) | (topk_ids >= vocab_size)).any(dim=1)
    sampled_outside = (sampled_ids < 0) | (sampled_ids >= vocab_size)

    def out_of_range(keep):
        raise TopKInputError(
            f"top-K or sampled token ids outside the vocabulary [0, {vocab_size}): the rollout engine and the actor "
            "use different vocabularies (check actor_rollout_ref.model.path and the tokenizer)"
        )

    problems = [(outside, out_of_range), (sampled_outside, out_of_range)]
    if topk_ids.shape[1] > 1:
        ordered = topk_ids.sort(dim=1).values
        duplicate_rows = (ordered[:, 1:] == ordered[:, :-1]).any(dim=1)

        def repeated(keep):
            raise TopKInputError(
                f"{int((duplicate_rows if keep is None else duplicate_rows & keep).sum())} rows of rollout_topk_ids "
                "repeat a token id: the rollout's top-K extraction is broken (each row must hold K distinct ids)"
            )

        problems.append((duplicate_rows, repeated))
    return problems


def mu_problems(mu_lp: torch.Tensor, log_mass_mu: torch.Tensor, mass_tolerance: float) -> list[Problem]:
    """log mu at the kept slots ([N, S], -inf at dropped ones; the last slot a_t's) NaN or +inf, then mu's kept mass
    (log, [N]) above 1 + mass_tolerance: per row, on the device (no wait)."""
    unusable = torch.isnan(mu_lp) | (mu_lp == math.inf)

    def not_finite(keep):
        _raise_unusable(unusable if keep is None else unusable[keep])

    def above_one(keep):
        worst = float((log_mass_mu if keep is None else log_mass_mu[keep]).max().exp())
        raise TopKInputError(
            f"the rollout's top-K probabilities sum to {worst:.4f} > 1: they are not log-probs of one distribution "
            "(actor_rollout_ref.rollout.logprobs_mode must be raw_logprobs or processed_logprobs, not *_logits)"
        )

    return [(unusable.any(dim=1), not_finite), (log_mass_mu > math.log1p(mass_tolerance), above_one)]


def _raise_unusable(unusable: torch.Tensor) -> None:
    """NaN/+inf log mu at kept slots: the error names the top-K rows or a_t's own log-prob (last slot)."""
    counts = unusable[:, :-1].any(dim=1).sum().item(), unusable[:, -1].sum().item()
    names = (
        "the rollout's top-K log-probs (rollout_topk_logprobs) contain",
        "the rollout's log-prob of the sampled token (rollout_sampled_logprobs) is",
    )
    found = [f"{name} NaN or +inf at {c} of {unusable.shape[0]} rows" for name, c in zip(names, counts) if c]
    raise TopKInputError(" and ".join(found) + ": mask such tokens out (verl's logits hook drops them)")


def _validate_rows(topk_ids: torch.Tensor, sampled_ids: torch.Tensor, vocab_size: int) -> None:
    """`row_problems`, raised (one wait)."""
    raise_first(row_problems(topk_ids, sampled_ids, vocab_size))
