"""TROLL's per-token terms fused with the LM head: the sparse support and pi on it from the hidden states and the LM
head weight, chunk by chunk, the [T, V] logits never existing (verl's `use_fused_kernels`).

Pure torch (no verl import). Entry point: `fused_troll_token_terms`, the counterpart of
`verl_dppo.math.troll.troll_token_terms` (same TrollTerms; the module doc of `verl_dppo.math.troll` gives the
support, the "other" atom and the projection). What differs is only how pi is read: each chunk's logits come from
the autograd function of `verl_dppo.math.fused_topk` (recomputed in the backward), and this module's selector finds
S_t = Top(mu) U {a_t} U Top(pi) in them with `troll_support.support_in_chunk`, the rule the logits path uses.
`troll.troll_terms_from_support` then does the rest, the same code as for the logits.

The same pass returns log pi(a_t) on every row (verl's log_prob, which the fused kernel replaces) and the entropy;
rows outside the update get the support {a_t} alone.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from verl_dppo.math.fused_slots import DEFAULT_CHUNK_TOKENS, ChunkSlots, fused_slot_logprobs
from verl_dppo.math.topk import check_topk_inputs
from verl_dppo.math.troll import (
    EPS,
    MASS_TOLERANCE,
    SUPPORT_MASS,
    TOPK,
    TrollInputError,
    TrollTerms,
    troll_terms_from_support,
)
from verl_dppo.math.kernels import LANES, backend_for, logits_at, sorted_excluded
from verl_dppo.math.troll_support import (
    CandidateReads,
    candidate_room,
    pi_read_width,
    read_candidates,
    support_by_kernel,
    support_by_topk,
    support_from_candidates,
    support_in_chunk,
)

__all__ = ["FusedPolicy", "fused_troll_token_terms"]


class FusedPolicy(NamedTuple):
    """What verl's fused kernel would have returned, from the same pass: [T] each, with gradient."""

    log_p_sampled: torch.Tensor  # log pi(a_t) on every row
    entropy: Optional[torch.Tensor]  # None unless asked


class _SupportSelector:
    """Per chunk, S_t as `support_in_chunk` finds it (the torch path), or on the kernels' path deferred
    (`fused_slot_logprobs`' `read` / `finish`): each chunk's logits read by the two kernels (`read_candidates`: the
    row max, the tail's sum below pi's threshold, the candidates' ids and logits), and S_t selected from those reads
    after the pass, for many chunks' rows in one go (`support_from_candidates`): a few launches per chunk, no wait.
    S_t comes first in `width` slots, padding slots repeating a_t and dropped; rows outside `troll_rows` keep {a_t}
    only. extra = each slot's candidate column (mu's source for `mu_on_atoms`). The crowded rows (more logits at
    the threshold than the candidates' room) come back as `again` and are selected with torch's top-k."""

    def __init__(
        self, sampled, mu_ids, mu_selected, troll_rows, k_pi: int, support_mass: float, width: int, vocab: int
    ):
        self.sampled, self.mu_ids, self.mu_selected, self.troll_rows = sampled, mu_ids, mu_selected, troll_rows
        self.k_pi, self.support_mass, self.width = k_pi, support_mass, width
        self.pi_width = pi_read_width(k_pi, vocab)
        self.capacity = candidate_room(self.pi_width)
        # the kernels' threshold needs pi's read width within the lanes; else torch's top-k per chunk
        self.read = self._read if self.pi_width <= LANES else None
        # the selection's peak memory per row (`support_from_candidates`, its outputs included): 12 int64 tensors
        # as wide as the candidates (27.2 KB a row measured at K = 64, 31.2 KB allowed: tests/test_fused_topk.py)
        self.bytes_per_row = 12 * 8 * (1 + mu_ids.shape[1] + self.capacity)
        self.known = self.known_sorted = None

    def _chunk(self, index):
        return self.sampled[index], self.mu_ids[index], self.mu_selected[index]

    def __call__(self, block, scratch, index, again=False):
        if backend_for(block) == "triton":  # the kernels read the chunk's logits in place
            # the rows `finish` flagged: more logits at the threshold than the candidates' room
            read = support_by_topk if again else support_by_kernel
            s = read(block, None, *self._chunk(index), self.k_pi, self.support_mass, self.troll_rows[index])
            # |S_t| <= 1 + K + k_pi: the slots past the caller's width are padding
            ids, valid, source = s.ids[:, : self.width], s.valid[:, : self.width], s.source[:, : self.width]
            return ChunkSlots(ids, ~valid, s.row_max, s.tail, logits_at(block, None, ids), source)
        s = support_in_chunk(block, scratch, *self._chunk(index), self.k_pi, self.support_mass, self.troll_rows[index])
        return ChunkSlots(s.ids, ~s.valid, s.row_max, s.tail, block.gather(1, s.ids), s.source)

    def _read(self, block, index):
        if self.known is None:  # a_t and mu's ids of every row, and their order for the kernel, once
            self.known = torch.cat([self.sampled[:, None], self.mu_ids], dim=1)
            self.known_sorted = sorted_excluded(self.known, block.shape[1])
        return tuple(
            read_candidates(block, None, self.known[index], self.pi_width, self.capacity, self.known_sorted[index])
        )

    def finish(self, reads, index) -> ChunkSlots:
        s, slot_logits, crowded = support_from_candidates(
            CandidateReads(*reads),
            *self._chunk(index),
            self.k_pi,
            self.support_mass,
            self.pi_width,
            self.troll_rows[index],
        )
        w = self.width
        return ChunkSlots(
            s.ids[:, :w], ~s.valid[:, :w], s.row_max, s.tail, slot_logits[:, :w], s.source[:, :w], crowded
        )


def fused_troll_token_terms(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    rollout_topk_ids: torch.Tensor,
    rollout_topk_logprobs: torch.Tensor,
    sampled_ids: torch.Tensor,
    rollout_sampled_logprobs: torch.Tensor,
    mask: Optional[torch.Tensor] = None,
    *,
    temperature: float = 1.0,
    eps: float = EPS,
    support_mass: float = SUPPORT_MASS,
    topk: int = TOPK,
    entropy: bool = False,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    mass_tolerance: float = MASS_TOLERANCE,
) -> tuple[TrollTerms, FusedPolicy]:
    """`troll_token_terms` on logits = hidden @ weight^T / temperature, without the logits.

    Args:
        hidden: [T, H] the last hidden states; weight: [V, H] the LM head (both usually with gradient).
        rollout_topk_ids, rollout_topk_logprobs, sampled_ids, rollout_sampled_logprobs, mask, eps, support_mass,
            topk, mass_tolerance: as `troll_token_terms`. sampled_ids holds a valid token id on every row (verl's
            labels): log pi(a_t) is read on every row.
        entropy: also return pi's entropy per row.

    Returns:
        (TrollTerms as `troll_token_terms` returns them, FusedPolicy: log pi(a_t) and the entropy on every row);
        gradients reach hidden and weight through log_p_sampled, regression_kl and the FusedPolicy.

    Raises:
        TrollInputError: as `troll_token_terms`, and ids outside [0, V) on any row.
    """
    check_topk_inputs(
        hidden, rollout_topk_ids, rollout_topk_logprobs, sampled_ids, rollout_sampled_logprobs, mask, TrollInputError
    )
    n, vocab = hidden.shape[0], weight.shape[0]
    sampled_all = sampled_ids.long()

    def sampled_outside(_keep):
        raise TrollInputError(
            f"sampled token ids outside the vocabulary [0, {vocab}): the rollout engine and the actor use different "
            "vocabularies (check actor_rollout_ref.model.path and the tokenizer)"
        )

    # log pi(a_t) is read on every row: a_t checked on every row, read with TROLL's own checks (one wait)
    every_row = [((sampled_all < 0) | (sampled_all >= vocab), sampled_outside)]
    out_dtype = torch.promote_types(torch.promote_types(hidden.dtype, weight.dtype), torch.float32)
    k_pi = min(topk, vocab)
    policy: dict[str, torch.Tensor] = {}

    def run(rows_arg, mu_ids_rows, mu_selected_rows, report=None):
        """The fused pass over every row; rows_arg (None: all) hold the update's rows, in that order; report: gets
        S_t's widest row's size ("kept"), read after the pass with the crowded rows (`fused_slot_logprobs`)."""
        mu_ids = torch.zeros(n, mu_ids_rows.shape[1], dtype=torch.long, device=hidden.device)
        mu_selected = torch.zeros(n, mu_ids_rows.shape[1], dtype=torch.bool, device=hidden.device)
        troll_rows = torch.zeros(n, dtype=torch.bool, device=hidden.device)
        index = slice(None) if rows_arg is None else rows_arg
        mu_ids[index], mu_selected[index], troll_rows[index] = mu_ids_rows, mu_selected_rows, True
        width = 1 + mu_ids.shape[1] + pi_read_width(k_pi, vocab)
        select = _SupportSelector(sampled_all, mu_ids, mu_selected, troll_rows, k_pi, support_mass, width, vocab)
        log_pi, log_other, ent, ids, dropped, source = fused_slot_logprobs(
            hidden, weight, temperature, select, width, entropy, chunk_tokens, scratch=True, report=report
        )
        valid = ~dropped
        slot = ((ids == sampled_all[:, None]) & valid).long().argmax(dim=1, keepdim=True)  # a_t is always kept
        policy.update(log_p_sampled=log_pi.gather(1, slot).squeeze(1).to(out_dtype), entropy=ent)
        return log_pi, log_other, ids, source, valid

    def read_support(rows_arg, sampled, mu_ids_rows, mu_selected_rows):
        report: dict[str, int] = {}
        log_pi, log_other, ids, source, valid = run(rows_arg, mu_ids_rows, mu_selected_rows, report)
        if rows_arg is not None:
            log_pi, log_other, ids, source, valid = (t[rows_arg] for t in (log_pi, log_other, ids, source, valid))
        used = report["kept"]  # over every row: those outside the update hold {a_t} alone
        return ids[:, :used], source[:, :used], valid[:, :used], log_pi[:, :used], log_other

    terms = troll_terms_from_support(
        read_support,
        vocab,
        out_dtype,
        rollout_topk_ids,
        rollout_topk_logprobs,
        sampled_ids,
        rollout_sampled_logprobs,
        mask,
        eps=eps,
        support_mass=support_mass,
        topk=topk,
        mass_tolerance=mass_tolerance,
        checks_everywhere=every_row,
    )
    if not policy:  # no row in the update: troll_terms_from_support read nothing, verl still needs log pi(a_t)
        empty = torch.zeros(n, 0, dtype=torch.long, device=hidden.device)
        run(None, empty, empty.bool())
        # run() marked every row as TROLL's with an empty mu: pi's top would join the support, which changes no
        # value of log pi(a_t) or the entropy.
    return terms, FusedPolicy(policy["log_p_sampled"], policy["entropy"] if entropy else None)
