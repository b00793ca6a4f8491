"""TROLL's sparse support from the full logits, chunk by chunk or by the kernels: S_t = {a_t} U Top(mu) U Top(pi),
pi's normaliser and its tail. Part of `verl_dppo.math.troll`, the public entry point (its module doc gives the support
rule, the "other" bucket and what backward keeps); `verl_dppo.math.troll_support_grad` is pi on S_t U {other} with
autograd built on it (the logits saved, not copied; softmax recomputed in backward).
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional

import torch

from verl_dppo.math.kernels import (
    LANES,
    logits_at,
    max_and_sum_exp_outside,
    sum_exp_below,
    top_threshold,
)

__all__ = [
    "top_selected",
    "pi_read_width",
    "support_by_kernel",
    "support_by_topk",
    "CandidateReads",
    "candidate_room",
    "read_candidates",
    "support_from_candidates",
]

CANDIDATE_ROOM = 256
"""Room per row for pi's candidates in `support_by_kernel` (at least 4x pi's read width): a real row has a few more
than k_pi + 1 (the lanes' threshold sits just below pi's (k_pi + 1)-th logit); a flat row of ties may have more,
and is read again with torch's top-k."""


def _candidates(sampled, mu_ids, pi_ids):
    """Every id that may enter S_t, {a_t} U mu's reported ids U Top-K(pi), sorted by id. `first` marks the first
    occurrence of each id, which comes from the best-known source for mu (a_t, then mu's report, then pi's top);
    `source` is the candidate column (0: a_t, 1..K: mu's report, then pi's top)."""
    candidates = torch.cat([sampled[:, None], mu_ids, pi_ids], dim=1)
    width = candidates.shape[1]
    key = (candidates * width + torch.arange(width, device=candidates.device)).sort(dim=1).values
    ids, source = key // width, key % width
    first = torch.ones_like(ids, dtype=torch.bool)
    first[:, 1:] = ids[:, 1:] != ids[:, :-1]
    return candidates, ids, source, first


def _kept(ids, source, first, selected):
    """S_t: the ids with at least one selected occurrence (`selected` per candidate column), once each."""
    group = first.long().cumsum(dim=1) - 1
    group_selected = torch.zeros_like(ids).scatter_add_(1, group, selected.gather(1, source).long()) > 0
    return first & group_selected.gather(1, group)


class ChunkSupport(NamedTuple):
    """S_t in one chunk of rows: ids [n, width] (S_t first, padding slots repeating a_t), their candidate columns
    (`_candidates`' source), valid (False on padding), and per row the max logit, the tail's exponentials
    sum(exp(l_j - max)) off S_t and the log-normaliser."""

    ids: torch.Tensor
    source: torch.Tensor
    valid: torch.Tensor
    row_max: torch.Tensor
    tail: torch.Tensor
    log_z: torch.Tensor


def pi_read_width(k_pi: int, vocab: int) -> int:
    """How many of pi's most likely ids are read to find Top(pi) with at most k_pi of them: one more than k_pi,
    to see whether the k_pi-th shares its logit with the next (`top_selected`)."""
    return min(k_pi + 1, vocab)


def top_selected(values: torch.Tensor, probs: torch.Tensor, limit: int, support_mass: float) -> torch.Tensor:
    """Top(q) on q's most likely entries, sorted by decreasing `values` (logits or log-probs; `probs` the
    probabilities): the smallest prefix holding `support_mass`, at most `limit` entries, taken in whole groups of
    tied values. A group is in when the mass strictly above it is below support_mass and it ends within `limit`.

    Why groups: bf16 logits over 151,936 tokens tie often, and a sort breaks a tie by position (differently on CPU
    and CUDA). Cutting a group changes S_t with the vocabulary's order or the device, and one token more or less in
    S_t moves KL(pi' || mu') by ~0.01. The cumulative-mass rule keeps a boundary group (it grows S_t by a few tied
    tokens); the `limit` rule drops one (a group that reaches past `limit` cannot be told apart from the next
    tokens without reading them all), so S_t never holds more than `limit` of q's ids."""
    k = values.shape[1]
    position = torch.arange(k, device=values.device).expand_as(values)
    starts = torch.ones_like(values, dtype=torch.bool)
    starts[:, 1:] = values[:, 1:] != values[:, :-1]
    ends = torch.ones_like(starts)
    ends[:, :-1] = starts[:, 1:]
    group_start = torch.where(starts, position, 0).cummax(dim=1).values
    group_end = torch.where(ends, position, k - 1).flip(1).cummin(dim=1).values.flip(1)
    # Tied entries have equal probabilities, so the mass before a group does not depend on the order inside ties.
    mass_above = (probs.cumsum(dim=1) - probs).gather(1, group_start)
    return (mass_above < support_mass) & (group_end < limit)


def support_in_chunk(
    block, scratch, sampled, mu_ids, mu_selected, k_pi: int, support_mass: float, pi_rows: Optional[torch.Tensor] = None
) -> ChunkSupport:
    """S_t = {a_t} U Top(mu) U Top(pi) from a chunk's logits `block` [n, V] (`scratch`: a buffer of its shape,
    overwritten). Top(pi): pi's smallest prefix of its k_pi most likely ids holding `support_mass`, in whole tie
    groups (`top_selected`), only on `pi_rows` (bool [n]; None: every row). One pass over the vocabulary for the
    normaliser and the tail."""
    top_logits, top_ids = block.topk(pi_read_width(k_pi, block.shape[1]), dim=1)
    row_max = top_logits[:, :1]
    shifted_exp = torch.sub(block, row_max, out=scratch).exp_()
    candidates, c_ids, c_source, c_first = _candidates(sampled, mu_ids, top_ids)
    c_exp = torch.where(c_first, shifted_exp.gather(1, c_ids), 0.0)
    rest = shifted_exp.scatter_(1, candidates, 0.0).sum(dim=1)  # every id that is no candidate
    return _support(
        top_logits,
        row_max.squeeze(1),
        rest,
        c_ids,
        c_source,
        c_first,
        c_exp,
        sampled,
        mu_selected,
        k_pi,
        support_mass,
        pi_rows,
    )


class CandidateReads(NamedTuple):
    """What the two kernels read of a chunk's logits for S_t (`read_candidates`): all TROLL needs of the rows'
    logits to find S_t, pi's normaliser and its tail, and the logits at every candidate, so S_t can be selected
    later, for many chunks in one go (`support_from_candidates`), the logits gone."""

    row_max: torch.Tensor  # float32 [n]
    rest: torch.Tensor  # float32 [n]: sum of exp(l - max) below the threshold, off a_t and mu's ids
    count: torch.Tensor  # int64 [n]: the columns at or above the threshold (more than `found` holds: crowded)
    found: torch.Tensor  # int32 [n, capacity]: those columns' ids, in no order, -1 after the count
    found_logits: torch.Tensor  # [n, capacity] their logits in the logits' dtype (at id 0 after the count)
    known_logits: torch.Tensor  # [n, 1 + K] the logits at a_t and mu's ids, in the logits' dtype


def candidate_room(width: int) -> int:
    """The columns `sum_exp_below` keeps per row for pi's candidates, pi's read width being `width`."""
    return max(CANDIDATE_ROOM, 4 * width)


def _picked(logits, rows, ids):
    """logits[rows][:, ids] in the logits' own dtype (exact; promoted where used)."""
    return logits.gather(1, ids) if rows is None else logits[rows[:, None], ids]


def read_candidates(
    logits, rows, known: torch.Tensor, width: int, capacity: int, known_sorted: Optional[torch.Tensor] = None
) -> CandidateReads:
    """The kernels' two reads of the selected `rows` of the logits (`support_by_kernel`'s steps 1 and 2), and the
    logits at the candidates: `known` [n, 1 + K] (a_t, then mu's ids) and the columns found at pi's threshold.
    known_sorted: `kernels.sorted_excluded(known)`, when the caller sorted it once for many chunks."""
    row_max, threshold = top_threshold(logits, width - 1, rows)
    excluded = known if known_sorted is None else known_sorted
    rest, count, found = sum_exp_below(
        logits, excluded, row_max, threshold, capacity, rows, presorted=known_sorted is not None
    )
    return CandidateReads(
        row_max, rest, count, found, _picked(logits, rows, found.clamp(min=0).long()), _picked(logits, rows, known)
    )


def support_from_candidates(
    reads: CandidateReads,
    sampled,
    mu_ids,
    mu_selected,
    k_pi: int,
    support_mass: float,
    width: int,
    pi_rows: Optional[torch.Tensor] = None,
    used: Optional[int] = None,
):
    """S_t from what `read_candidates` read (no logits needed): (ChunkSupport, the logits at its slots in float32
    at least [n, slots], crowded bool [n]: rows with more columns at the threshold than `found` holds, whose
    S_t here is wrong and must be read another way). used: how many of `found`'s columns to look at (None: all;
    at least pi's read width `width`)."""
    found = reads.found if used is None else reads.found[:, :used]
    found = found.long()
    present = found >= 0
    work = torch.promote_types(reads.found_logits.dtype, torch.float32)
    values = torch.where(present, reads.found_logits[:, : found.shape[1]].to(work), -math.inf)
    values, order = values.sort(dim=1, descending=True)
    present = present.gather(1, order)
    pi_ids = torch.where(present, found.gather(1, order), sampled[:, None])
    known = reads.known_logits.to(work)
    # the logits at `_candidates`' columns: a_t, mu's ids, then pi's (a missing one repeats a_t)
    column_logits = torch.cat([known, torch.where(present, values, known[:, :1])], dim=1)
    _, c_ids, c_source, c_first = _candidates(sampled, mu_ids, pi_ids)
    c_exp = torch.where(c_first, (column_logits.gather(1, c_source) - reads.row_max[:, None]).exp(), 0.0)
    support = _support(
        values[:, :width],
        reads.row_max,
        reads.rest,
        c_ids,
        c_source,
        c_first,
        c_exp,
        sampled,
        mu_selected,
        k_pi,
        support_mass,
        pi_rows,
        pi_columns=found.shape[1],
    )
    slot_logits = torch.where(support.valid, column_logits.gather(1, support.source), known[:, :1])
    return support, slot_logits, reads.count > reads.found.shape[1]


def support_by_kernel(
    logits, rows, sampled, mu_ids, mu_selected, k_pi: int, support_mass: float, pi_rows: Optional[torch.Tensor] = None
) -> ChunkSupport:
    """`support_in_chunk` on the selected `rows` of the whole logits, read in place by two kernels
    (`verl_dppo.math.kernels`), no [n, V] temporary and no sort of the vocabulary:

    1. `top_threshold`: the row max and a lower bound t of pi's (k_pi + 1)-th largest logit;
    2. `sum_exp_below`: the ids at or above t (a few more than k_pi + 1 on real rows), and the tail's sum of
       exp(l - max) over the columns below t that are neither a_t nor mu's ids.

    pi's top k_pi + 1 are the largest of those candidates, exactly (every logit >= t is among them, ties included);
    all of them stay candidates of S_t, so the tail is the same sum as the torch path's, grouped otherwise. A row
    with more candidates than room (a flat row of ties) is read again with torch's top-k (`support_by_topk`).
    One wait for the device (the candidates' columns in use and the crowded rows' count). The fused path reads
    its chunks with `read_candidates` and selects S_t for many chunks at once with `support_from_candidates`."""
    width = pi_read_width(k_pi, logits.shape[1])
    if width > LANES:
        return support_by_topk(logits, rows, sampled, mu_ids, mu_selected, k_pi, support_mass, pi_rows)
    capacity = candidate_room(width)
    reads = read_candidates(logits, rows, torch.cat([sampled[:, None], mu_ids], dim=1), width, capacity)
    used, crowded_rows = width, 0
    if reads.count.numel():  # the candidates' columns in use and the crowded rows' count: one wait
        most, crowded_rows = torch.stack([reads.count.max(), (reads.count > capacity).sum()]).tolist()
        used = max(width, min(most, capacity))
    support, _, crowded = support_from_candidates(
        reads, sampled, mu_ids, mu_selected, k_pi, support_mass, width, pi_rows, used
    )
    if crowded_rows == 0:
        return support
    crowded = torch.argsort((~crowded).to(torch.uint8), stable=True)[:crowded_rows]  # ascending
    again = support_by_topk(
        logits,
        crowded if rows is None else rows[crowded],
        sampled[crowded],
        mu_ids[crowded],
        mu_selected[crowded],
        k_pi,
        support_mass,
        None if pi_rows is None else pi_rows[crowded],
    )
    return _overwrite_rows(support, crowded, again, sampled)


def _overwrite_rows(support: ChunkSupport, at: torch.Tensor, other: ChunkSupport, sampled) -> ChunkSupport:
    """`support` with its rows `at` replaced by `other`'s, the slot columns padded to the wider of the two."""
    width = max(support.ids.shape[1], other.ids.shape[1])

    def padded(s: ChunkSupport, fill_ids) -> ChunkSupport:
        extra = width - s.ids.shape[1]
        if extra == 0:
            return s
        pad = fill_ids[:, None].expand(-1, extra)
        return s._replace(
            ids=torch.cat([s.ids, pad], dim=1),
            source=torch.cat([s.source, torch.zeros_like(pad)], 1),
            valid=torch.cat([s.valid, torch.zeros_like(pad, dtype=torch.bool)], dim=1),
        )

    support, other = padded(support, sampled), padded(other, sampled[at])
    return ChunkSupport(*(mine.index_copy(0, at, theirs) for mine, theirs in zip(support, other)))


def support_by_topk(logits, rows, sampled, mu_ids, mu_selected, k_pi, support_mass, pi_rows=None) -> ChunkSupport:
    """`support_by_kernel` with torch's top-k for pi's most likely ids, then one kernel for the tail's exponentials.
    Most rows: every row read in place, no row copies; a few rows (the crowded ones): those rows copied first."""
    width = pi_read_width(k_pi, logits.shape[1])
    if rows is not None and 4 * rows.numel() < logits.shape[0]:
        top_logits, top_ids = logits.index_select(0, rows).topk(width, dim=1)
    else:
        top_logits, top_ids = logits.topk(width, dim=1)
        if rows is not None:
            top_logits, top_ids = top_logits.index_select(0, rows), top_ids.index_select(0, rows)
    top_logits = top_logits.to(torch.promote_types(logits.dtype, torch.float32))
    row_max = top_logits[:, 0]
    candidates, c_ids, c_source, c_first = _candidates(sampled, mu_ids, top_ids)
    _, rest = max_and_sum_exp_outside(logits, candidates, rows, row_max)
    c_exp = torch.where(c_first, (logits_at(logits, rows, c_ids) - row_max[:, None]).exp(), 0.0)
    return _support(
        top_logits, row_max, rest, c_ids, c_source, c_first, c_exp, sampled, mu_selected, k_pi, support_mass, pi_rows
    )


def _support(
    top_logits,
    row_max,
    rest,
    c_ids,
    c_source,
    c_first,
    c_exp,
    sampled,
    mu_selected,
    k_pi,
    support_mass,
    pi_rows=None,
    pi_columns: Optional[int] = None,
) -> ChunkSupport:
    """S_t and pi's normaliser and tail from pi's top logits, the sum of exp(l - max) over the non-candidates
    (`rest`) and the candidates' own exp(l - max) (`c_exp`, 0 on repeats). pi_columns: how many of the candidate
    columns are pi's (None: as many as top_logits; more when pi's candidates go on past its top)."""
    log_z = row_max + (rest + c_exp.sum(dim=1)).log()
    pi_selected = top_selected(top_logits, (top_logits - log_z[:, None]).exp(), k_pi, support_mass)
    if pi_columns is not None and pi_columns > pi_selected.shape[1]:
        pi_selected = torch.nn.functional.pad(pi_selected, (0, pi_columns - pi_selected.shape[1]), value=False)
    if pi_rows is not None:
        pi_selected &= pi_rows[:, None]
    always = torch.ones_like(sampled[:, None], dtype=torch.bool)  # a_t
    keep = _kept(c_ids, c_source, c_first, torch.cat([always, mu_selected, pi_selected], dim=1))
    # pi(other) from the tail's own exponentials: exact however close pi's support mass is to 1.
    tail = rest + torch.where(keep, 0.0, c_exp).sum(dim=1)
    order = (~keep).long().argsort(dim=1, stable=True)  # S_t first; padding slots repeat a_t
    ids = torch.where(keep, c_ids, sampled[:, None]).gather(1, order)
    return ChunkSupport(ids, c_source.gather(1, order), keep.gather(1, order), row_max, tail, log_z)
