"""Patch of `verl.workers.rollout.sglang_rollout.async_sglang_server.SGLangHttpServer.generate`: mu's top-K.

Which verl method: `SGLangHttpServer.generate` asks SGLang for the sampled token's log-prob only (`top_logprobs_num`
is set for prompt log-probs, never for the generation) and returns a `TokenOutput`.
What the wrapper does, for the Top-K modes only: `top_logprobs_num=K` on the request (through the module's
`GenerateReqInput`), the engine's final output captured per request, `meta_info["output_top_logprobs"]` extracted
into `extra_fields` (`_server_common`).
Why no extension point: verl 0.9.1 has no per-request "extra sampling outputs" option for its servers.
What would make it unnecessary: a rollout option `return_top_logprobs: K` that fills `TokenOutput.extra_fields`
(verl's distillation would use it too).
"""

from __future__ import annotations

from itertools import chain
from operator import itemgetter
from typing import Any, Sequence

import numpy as np

from verl_dppo.patches._import_hook import patch_once
from verl_dppo.patches._server_common import (
    EXTRA_IDS,
    EXTRA_LOGPROBS,
    REQUEST_K,
    RolloutTopKError,
    capture_outputs_of,
    generate_capturing,
    rollout_topk,
    warn_truncated_sampling,
)

__all__ = ["check_original_logprob", "extract_sglang_topk", "patch_sglang_server"]


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


ORIGINAL_LOGPROB_ENV = "SGLANG_RETURN_ORIGINAL_LOGPROB"


def check_original_logprob(sampling_params: dict) -> None:
    """SGLang reports log-probs of the distribution it sampled from (after temperature) unless
    SGLANG_RETURN_ORIGINAL_LOGPROB is set, when they are of the logits before temperature: at a temperature other than
    1 the rows (and the sampled log-prob) would then not be mu's. Refused for the Top-K modes and troll."""
    import os

    flag = os.environ.get(ORIGINAL_LOGPROB_ENV, "").strip().lower() in ("1", "true", "yes", "on")
    temperature = float(
        sampling_params.get("temperature", 1.0) if sampling_params.get("temperature") is not None else 1.0
    )
    if flag and abs(temperature - 1.0) > 1e-6:
        raise RolloutTopKError(
            f"{ORIGINAL_LOGPROB_ENV} is set in the SGLang server's environment and the rollout samples at temperature "
            f"{temperature:g}: SGLang then reports log-probs before temperature, not of the distribution it sampled "
            f"from (mu), so mu's top-K rows would be wrong. Unset {ORIGINAL_LOGPROB_ENV}, or sample at temperature 1"
        )


def patch_sglang_server(module: Any) -> None:
    """SGLangHttpServer.generate: top_logprobs_num=K on the request, the generation's top-K in extra_fields."""
    original_request = module.GenerateReqInput

    def GenerateReqInput(*args, **kwargs):  # noqa: N802
        k = REQUEST_K.get()
        if k is not None:
            if kwargs.get("logprob_start_len", None) is not None:
                raise RolloutTopKError("Top-K DPPO and prompt log-probs in one SGLang request are not supported")
            kwargs["return_logprob"] = True
            kwargs["top_logprobs_num"] = k
        return original_request(*args, **kwargs)

    def make(original_generate):
        async def generate(self, prompt_ids, sampling_params, request_id, *args, **kwargs):
            k = rollout_topk(self.config)
            # Prefill/decode disaggregation: a prefill server generates no token (its top-level call fans out to a
            # decode peer, whose own patched `generate` returns the rows; its prefill leg only fills the KV cache).
            # The decode leg carries a bootstrap_room too (verl async_sglang_server.py:572,582) and must return rows.
            if k is None or getattr(self, "_disaggregation_role", None) == "prefill":
                return await original_generate(self, prompt_ids, sampling_params, request_id, *args, **kwargs)
            check_original_logprob(sampling_params)
            warn_truncated_sampling(sampling_params, None)
            capture_outputs_of(self.tokenizer_manager, "generate_request")
            result, output = await generate_capturing(
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
