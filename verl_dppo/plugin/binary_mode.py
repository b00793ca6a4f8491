"""The binary family: D_t from the sampled token's two log-probs alone, and the baselines measured with them.

    dppo_binary_tv   Eq. (12) with D = |mu(a_t) - pi(a_t)|                                   (Eq. 13)
    dppo_binary_kl   Eq. (12) with D = the KL of the two Bernoulli (a_t, not a_t)             (Eq. 14)
    grpo_clip        PPO's / GRPO's ratio clip as a mask, D = |r_t - 1| (Eq. 9), eps from clip_ratio_low/high;
                     with relax_below, the Relax variant of Sec. 6
    pg_is            no trust region; with a finite ratio_cap, PG-TIS (= CISPO)

The loss is Eq. (11) (`LossFamily.loss_matrix`). Anchored on mu (the default), D against the anchor is the mismatch
statistic the shared function already computed; with `anchor=recompute` (the decoupled ablation of Sec. 5.2) it is
measured against the recomputed old policy.
"""

from __future__ import annotations

from typing import Optional

import torch

from verl_dppo.math.divergence import binary_kl, binary_tv, ratio_deviation
from verl_dppo.plugin.loss_family import LossFamily, LossMode, Tokens

__all__ = ["FAMILY"]


class BinaryFamily(LossFamily):
    def divergence(self, tokens: Tokens) -> Optional[torch.Tensor]:
        measure = tokens.mode.divergence
        if measure is None:  # PG-IS
            return None
        if not tokens.anchored_on_mu:
            return measure(tokens.anchor, tokens.pi)
        # against mu, the mismatch statistics are already D; the ratio deviation from the ratio at hand
        at_hand = {binary_tv: tokens.mismatch_tv, binary_kl: tokens.mismatch_kl}.get(measure)
        return at_hand if at_hand is not None else (tokens.ratio - 1.0).abs()


FAMILY = BinaryFamily(
    (
        LossMode(
            "dppo_binary_tv",
            "DPPO-Binary-TV: Eq. (12) with D = Eq. (13)",
            divergence=binary_tv,
            measure="tv",
            paper_delta=0.15,
            label="bTV",
            color="#d62728",
        ),
        LossMode(
            "dppo_binary_kl",
            "DPPO-Binary-KL: Eq. (12) with D = Eq. (14)",
            divergence=binary_kl,
            measure="kl",
            paper_delta=0.05,
            label="bKL",
            color="#ff7f0e",
        ),
        LossMode(
            "grpo_clip",
            "GRPO / Clip-Higher: ratio clip, Eq. (9); Relax: Sec. 6",
            divergence=ratio_deviation,
            uses_divergence_thresholds=False,
            label="clip",
            color="#1f77b4",
            panels="clip",
        ),
        LossMode(
            "pg_is", "PG-IS; with a finite ratio_cap, PG-TIS (= CISPO)", label="PG-IS", color="#7f7f7f", panels="clip"
        ),
    )
)
