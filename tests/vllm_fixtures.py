"""vLLM-shaped log-prob fixtures and the per-token baseline loop (tests and bench/bench_topk.py; not shipped)."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import numpy as np

__all__ = ["per_token_loop_vllm_topk", "vllm_shaped_logprobs", "flat_from_dicts"]


def per_token_loop_vllm_topk(position_logprobs: Sequence[Any], token_ids: Sequence[int], k: int):
    """The straightforward per-token version (a sort per position): the benchmark's baseline and a test oracle."""
    ids = np.zeros((len(position_logprobs), k), dtype=np.int64)
    lps = np.zeros((len(position_logprobs), k), dtype=np.float32)
    for i, entries in enumerate(position_logprobs):
        items = [(tok, lp) for tok, lp in entries.items() if not (len(entries) == k + 1 and tok == token_ids[i])]
        items.sort(key=lambda item: item[1].rank)
        for j, (tok, lp) in enumerate(items[:k]):
            ids[i, j] = tok
            lps[i, j] = lp.logprob
    return ids, lps


@dataclass
class _Logprob:
    """Field for field vLLM's `vllm.logprobs.Logprob` (a dataclass), for benchmarks and tests on a CPU machine."""

    logprob: float
    rank: Optional[int] = None
    decoded_token: Optional[str] = None


def vllm_shaped_logprobs(tokens: int, k: int, vocab: int, seed: int = 0, inside_fraction: float = 0.7):
    """Per-position dicts built the way vLLM builds them: sampled token first, then the top-K by rank (a sampled
    token among the top-K is overwritten by its top-K entry, so the dict keeps K entries)."""
    rng = random.Random(seed)
    positions, sampled_ids = [], []
    for _ in range(tokens):
        top = rng.sample(range(vocab), k)
        lps = sorted((-rng.expovariate(1.0) - 0.1 * j for j in range(k)), reverse=True)
        if rng.random() < inside_fraction:
            j = rng.randrange(k)
            sampled, sampled_entry = top[j], _Logprob(lps[j], j + 1, "")
        else:
            sampled = rng.randrange(vocab)
            while sampled in top:
                sampled = rng.randrange(vocab)
            sampled_entry = _Logprob(lps[-1] - 1.0 - rng.random(), k + 1 + rng.randrange(100), "")
        ids = [sampled] + top
        entries = [sampled_entry] + [_Logprob(lp, j + 1, "") for j, lp in enumerate(lps)]
        positions.append(dict(zip(ids, entries)))
        sampled_ids.append(sampled)
    return positions, sampled_ids


@dataclass
class _FlatLogprobs:
    """Field for field vLLM's `FlatLogprobs` (flat lists, sampled token first per position, no de-duplication)."""

    start_indices: list
    end_indices: list
    token_ids: list
    logprobs: list
    ranks: list
    decoded_tokens: list

    def __len__(self):
        return len(self.start_indices)


def flat_from_dicts(positions: Sequence[dict], sampled_ids: Sequence[int], k: int) -> _FlatLogprobs:
    """The FlatLogprobs vLLM builds for the same positions: sampled entry first, then the top-K, no de-duplication
    (a sampled token inside the top-K appears twice: K + 1 entries on every position)."""
    flat = _FlatLogprobs([], [], [], [], [], [])
    for entries, sampled in zip(positions, sampled_ids):
        flat.start_indices.append(len(flat.token_ids))
        # vLLM's flat layout: the sampled entry, then the top-K by rank (the dict may hold the sampled token once).
        top = sorted(
            ((token, lp) for token, lp in entries.items() if len(entries) == k or token != sampled),
            key=lambda item: item[1].rank,
        )
        items = [(sampled, entries[sampled])] + top
        for token, lp in items:
            flat.token_ids.append(token)
            flat.logprobs.append(lp.logprob)
            flat.ranks.append(lp.rank)
            flat.decoded_tokens.append(lp.decoded_token)
        flat.end_indices.append(len(flat.token_ids))
    return flat
