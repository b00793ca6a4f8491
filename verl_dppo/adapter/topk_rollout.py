"""Rollout side of Top-K DPPO: ask vLLM / SGLang for mu's top-K per generated token and extract it, vectorised.

Where K comes from: the single setting `actor_rollout_ref.actor.policy_loss.topk`. On the driver, the
`LLMServerManager.__init__` patch (adapter.topk_agent_loop.sync_rollout_config) copies it into
`actor_rollout_ref.rollout.custom.dppo_topk` before any rollout server is built (and raises vLLM's
`engine_kwargs.vllm.max_logprobs` to K when K > 20); the servers read it from their rollout config. A user never
sets `custom.dppo_topk` by hand (a value that disagrees with policy_loss.topk is refused).

The patched `generate` of each server puts two numpy arrays in `TokenOutput.extra_fields`:
`dppo_topk_ids` [T, K] int64 and `dppo_topk_logprobs` [T, K] float32, one row per generated token, sorted by rank.
"""

from __future__ import annotations

import contextvars
import functools
import logging
import random
from dataclasses import dataclass
from itertools import chain
from operator import attrgetter, itemgetter, methodcaller
from typing import Any, Optional, Sequence

import numpy as np

from verl_dppo.adapter.topk_import_hook import patch_once

__all__ = [
    "CUSTOM_KEY",
    "EXTRA_IDS",
    "EXTRA_LOGPROBS",
    "rollout_topk",
    "extract_vllm_topk",
    "extract_sglang_topk",
    "per_token_loop_vllm_topk",
    "vllm_shaped_logprobs",
    "patch_vllm_server",
    "patch_sglang_server",
]

logger = logging.getLogger("verl_dppo")

CUSTOM_KEY = "dppo_topk"
"""Key in actor_rollout_ref.rollout.custom that carries K to the servers (written by the driver-side patch)."""
EXTRA_IDS = "dppo_topk_ids"
EXTRA_LOGPROBS = "dppo_topk_logprobs"


class RolloutTopKError(ValueError):
    """The rollout engine's log-probs do not hold a well-formed top-K per generated token."""


def rollout_topk(rollout_config: Any) -> Optional[int]:
    """K requested by the run (written by the driver from policy_loss.topk), or None when Top-K is off."""
    custom = rollout_config.get("custom", None) if hasattr(rollout_config, "get") else getattr(rollout_config, "custom", None)
    if not custom:
        return None
    value = custom.get(CUSTOM_KEY, None)
    return int(value) if value is not None else None


# --------------------------------------------------------------------------------------------------- extraction


def extract_vllm_topk(position_logprobs: Sequence[Any], token_ids: Sequence[int], k: int) -> tuple[np.ndarray, np.ndarray]:
    """mu's top-K per generated token from vLLM's `CompletionOutput.logprobs`, without a per-token Python loop.

    With `SamplingParams(logprobs=K)` vLLM builds each position from (sampled token, top-K by rank), the sampled
    token first: as a dict {token_id: Logprob(logprob, rank, decoded_token)} that holds K entries when the sampled
    token is among the top-K and K + 1 when it is not, or as a `FlatLogprobs` (flat lists + start/end indices).
    Rows with K + 1 entries drop their first (the sampled token, checked); no per-token sort, no per-token loop:
    dict entries are flattened with C-level iterators, FlatLogprobs' lists are read as arrays directly.
    """
    n_tokens = len(position_logprobs)
    if n_tokens == 0:
        return np.zeros((0, k), dtype=np.int64), np.zeros((0, k), dtype=np.float32)
    if len(token_ids) < n_tokens:
        raise RolloutTopKError(f"{n_tokens} log-prob positions for {len(token_ids)} generated tokens")
    if hasattr(position_logprobs, "start_indices"):  # vLLM's FlatLogprobs
        starts = np.asarray(position_logprobs.start_indices, dtype=np.int64)[:n_tokens]
        counts = np.asarray(position_logprobs.end_indices, dtype=np.int64)[:n_tokens] - starts
        if starts[0] != 0 or not np.array_equal(starts[1:], (starts + counts)[:-1]):
            raise RolloutTopKError("FlatLogprobs positions are not contiguous")
        total = int(counts.sum())
        ids = np.fromiter(position_logprobs.token_ids, dtype=np.int64, count=total)
        logprobs = np.fromiter(position_logprobs.logprobs, dtype=np.float32, count=total)
    else:
        counts = np.fromiter(map(len, position_logprobs), dtype=np.int64, count=n_tokens)
        total = int(counts.sum())
        ids = np.fromiter(chain.from_iterable(position_logprobs), dtype=np.int64, count=total)
        entries = chain.from_iterable(map(methodcaller("values"), position_logprobs))
        logprobs = np.fromiter(map(attrgetter("logprob"), entries), dtype=np.float64, count=total)
    if not bool(((counts == k) | (counts == k + 1)).all()):
        bad = counts[(counts != k) & (counts != k + 1)]
        raise RolloutTopKError(
            f"vLLM returned {int(bad[0])} log-probs at a position, expected K={k} or K+1: the request did not ask "
            f"for logprobs=K (is the verl-dppo plugin installed in the rollout servers' environment?)"
        )
    sampled = np.fromiter(token_ids, dtype=np.int64, count=n_tokens)
    if total == n_tokens * (k + 1):  # every position holds K + 1 (always so for FlatLogprobs): a plain reshape
        ids, logprobs = ids.reshape(n_tokens, k + 1), logprobs.reshape(n_tokens, k + 1)
        if not np.array_equal(ids[:, 0], sampled):
            raise RolloutTopKError("a position holds K+1 log-probs but its first entry is not the sampled token")
        ids, logprobs = ids[:, 1:], logprobs[:, 1:]
    else:
        extra_rows = np.nonzero(counts == k + 1)[0]
        first = np.concatenate([[0], np.cumsum(counts)[:-1]])[extra_rows]
        if not np.array_equal(ids[first], sampled[extra_rows]):
            raise RolloutTopKError("a position holds K+1 log-probs but its first entry is not the sampled token")
        keep = np.ones(total, dtype=bool)
        keep[first] = False
        ids, logprobs = ids[keep].reshape(n_tokens, k), logprobs[keep].reshape(n_tokens, k)
    # Rank order (most likely first). vLLM lists the top-K by rank already, but a dict moves a sampled token that is
    # among them to the front: sort only when some row is out of order.
    if k > 1 and not bool((logprobs[:, :-1] >= logprobs[:, 1:]).all()):
        order = np.argsort(-logprobs, axis=1, kind="stable")
        ids, logprobs = np.take_along_axis(ids, order, 1), np.take_along_axis(logprobs, order, 1)
    return ids, logprobs.astype(np.float32)


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


def extract_sglang_topk(output_top_logprobs: Sequence[Sequence[Any]], k: int) -> tuple[np.ndarray, np.ndarray]:
    """mu's top-K per generated token from SGLang's meta_info["output_top_logprobs"].

    SGLang returns, per generated token, a list of `top_logprobs_num` tuples (logprob, token_id, text-or-None),
    most likely first; the sampled token is reported separately (output_token_logprobs).
    """
    n_tokens = len(output_top_logprobs)
    if n_tokens == 0:
        return np.zeros((0, k), dtype=np.int64), np.zeros((0, k), dtype=np.float32)
    counts = np.fromiter(map(len, output_top_logprobs), dtype=np.int64, count=n_tokens)
    if not bool((counts >= k).all()):
        raise RolloutTopKError(
            f"SGLang returned {int(counts.min())} top log-probs at a position, expected K={k}: the request did not "
            "ask for top_logprobs_num=K (is the verl-dppo plugin installed in the rollout servers' environment?)"
        )
    if bool((counts > k).any()):
        output_top_logprobs = [entries[:k] for entries in output_top_logprobs]
    flat = list(chain.from_iterable(output_top_logprobs))
    logprobs = np.fromiter(map(itemgetter(0), flat), dtype=np.float64, count=n_tokens * k).reshape(n_tokens, k)
    ids = np.fromiter(map(itemgetter(1), flat), dtype=np.int64, count=n_tokens * k).reshape(n_tokens, k)
    return ids, logprobs.astype(np.float32)


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
        top = sorted(((token, lp) for token, lp in entries.items() if len(entries) == k or token != sampled),
                     key=lambda item: item[1].rank)
        items = [(sampled, entries[sampled])] + top
        for token, lp in items:
            flat.token_ids.append(token)
            flat.logprobs.append(lp.logprob)
            flat.ranks.append(lp.rank)
            flat.decoded_tokens.append(lp.decoded_token)
        flat.end_indices.append(len(flat.token_ids))
    return flat


# ------------------------------------------------------------------------------------------------ server patches

_REQUEST_K: contextvars.ContextVar[Optional[int]] = contextvars.ContextVar("verl_dppo_request_k", default=None)
_CAPTURE: contextvars.ContextVar[Optional[dict]] = contextvars.ContextVar("verl_dppo_capture", default=None)
_warned: set[str] = set()


def _capture_outputs_of(engine: Any, name: str) -> None:
    """Make the engine's async-generator method `name` keep the current request's last output in _CAPTURE (an
    instance attribute: the engine object is created by the server, after the module is patched)."""
    original = getattr(engine, name)
    if getattr(original, "__verl_dppo_capture__", False):
        return

    @functools.wraps(original)
    async def capturing(*args, **kwargs):
        holder = _CAPTURE.get()
        async for output in original(*args, **kwargs):
            if holder is not None:
                holder["output"] = output
            yield output

    capturing.__verl_dppo_capture__ = True
    setattr(engine, name, capturing)


def warn_truncated_sampling(sampling_params: dict, logprobs_mode: Optional[str]) -> None:
    top_p = sampling_params.get("top_p", 1.0)
    top_k = sampling_params.get("top_k", -1)
    truncated = (top_p is not None and top_p < 1.0) or (top_k is not None and top_k > 0)
    if truncated and logprobs_mode == "processed_logprobs" and "truncated" not in _warned:
        _warned.add("truncated")
        logger.warning(
            "verl-dppo Top-K: top_p=%s / top_k=%s with rollout.logprobs_mode=processed_logprobs: the engine renormalises "
            "mu over the truncated support, so mu's top-K (and its 'other' mass) differ from the full policy the actor "
            "scores; use top_p=1.0, top_k=-1 for Top-K DPPO",
            top_p,
            top_k,
        )


def patch_vllm_server(module: Any) -> None:
    """vLLMHttpServer.generate: logprobs=K on the request, the top-K of every generated token in extra_fields."""
    original_sampling_params = module.SamplingParams

    def SamplingParams(*args, **kwargs):  # noqa: N802 (stands in for vLLM's class in this module only)
        k = _REQUEST_K.get()
        if k is not None:
            kwargs["logprobs"] = k  # verl forces 0 (sampled token only); K returns the top-K plus the sampled token
            if "flat_logprobs" in getattr(original_sampling_params, "__struct_fields__", ()):
                kwargs.setdefault("flat_logprobs", True)  # newer vLLM: flat lists, read as arrays (no objects)
        return original_sampling_params(*args, **kwargs)

    def make(original_generate):
        async def generate(self, prompt_ids, sampling_params, request_id, *args, **kwargs):
            k = rollout_topk(self.config)
            if k is None:
                return await original_generate(self, prompt_ids, sampling_params, request_id, *args, **kwargs)
            warn_truncated_sampling(sampling_params, self.config.get("logprobs_mode", None))
            _capture_outputs_of(self.engine, "generate")
            result, final = await _generate_capturing(
                original_generate, k, self, prompt_ids, sampling_params, request_id, *args, **kwargs
            )
            if final is not None and final.outputs and result.token_ids:
                ids, lps = extract_vllm_topk(final.outputs[0].logprobs, list(result.token_ids), k)
                result.extra_fields[EXTRA_IDS], result.extra_fields[EXTRA_LOGPROBS] = ids, lps
            return result

        return generate

    if patch_once(module.vLLMHttpServer, "generate", make):
        module.SamplingParams = SamplingParams


async def _generate_capturing(original_generate, k: int, *args, **kwargs):
    """Run a server's original `generate` with K requested and the engine's final output captured (per request:
    context variables follow the request's task). Returns (verl's TokenOutput, the engine's final output or None)."""
    holder: dict = {}
    k_token, capture_token = _REQUEST_K.set(k), _CAPTURE.set(holder)
    try:
        result = await original_generate(*args, **kwargs)
    finally:
        _REQUEST_K.reset(k_token)
        _CAPTURE.reset(capture_token)
    return result, holder.get("output")


def patch_sglang_server(module: Any) -> None:
    """SGLangHttpServer.generate: top_logprobs_num=K on the request, the generation's top-K in extra_fields."""
    original_request = module.GenerateReqInput

    def GenerateReqInput(*args, **kwargs):  # noqa: N802
        k = _REQUEST_K.get()
        if k is not None:
            if kwargs.get("logprob_start_len", None) is not None:
                raise RolloutTopKError("Top-K DPPO and prompt log-probs in one SGLang request are not supported")
            kwargs["return_logprob"] = True
            kwargs["top_logprobs_num"] = k
        return original_request(*args, **kwargs)

    def make(original_generate):
        async def generate(self, prompt_ids, sampling_params, request_id, *args, **kwargs):
            k = rollout_topk(self.config)
            if k is None or kwargs.get("bootstrap_room") is not None:  # PD prefill half: no generated tokens
                return await original_generate(self, prompt_ids, sampling_params, request_id, *args, **kwargs)
            warn_truncated_sampling(sampling_params, None)
            _capture_outputs_of(self.tokenizer_manager, "generate_request")
            result, output = await _generate_capturing(
                original_generate, k, self, prompt_ids, sampling_params, request_id, *args, **kwargs
            )
            if output is not None and result.token_ids:
                top = (output.get("meta_info", {}) or {}).get("output_top_logprobs") or []
                if len(top) != len(result.token_ids):
                    raise RolloutTopKError(
                        f"SGLang returned top log-probs for {len(top)} of {len(result.token_ids)} generated tokens"
                    )
                ids, lps = extract_sglang_topk(top, k)
                result.extra_fields[EXTRA_IDS], result.extra_fields[EXTRA_LOGPROBS] = ids, lps
            return result

        return generate

    if patch_once(module.SGLangHttpServer, "generate", make):
        module.GenerateReqInput = GenerateReqInput
