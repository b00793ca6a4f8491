"""Run verl 0.9.1's real `vLLMHttpServer.generate` (its source, unmodified) against a stand-in vLLM engine, with
the plugin's Top-K patch installed by the import hook; print what the server returns, as JSON.

vLLM does not install on a CPU machine: every `vllm.*` module is a stub whose attributes are dummy classes, except
`SamplingParams`, which records its arguments, and the engine, which answers like vLLM's AsyncLLM (per-position
dicts {token_id: Logprob} with the sampled token first and the top-`logprobs` entries by rank, or, when the request
asks for `flat_logprobs`, a `FlatLogprobs` as vLLM 0.27.1 builds it).
Usage: python vllm_server.py K [STOP [LOGPROBS]]  (K = 0: plugin not asked for Top-K; STOP: a stop string, "" for
none; LOGPROBS = 0: the request asks for no log-probs, as verl's agent loop without `calculate_log_probs`), or
python vllm_server.py --cases JSON: a list of such argument lists, each a fresh server and engine in this one process
(one import of verl instead of one per case), printed as one JSON list (stubs.run_cases).
"""

import asyncio
import os
import sys
import types
from dataclasses import dataclass

sys.path.insert(0, os.path.dirname(__file__))
import stubs  # noqa: E402

stubs.install("vllm")


class SamplingParams:
    # vLLM's SamplingParams is a msgspec Struct: the patch reads which options the installed vLLM has from here
    __struct_fields__ = ("max_tokens", "logprobs", "prompt_logprobs", "flat_logprobs", "detokenize", "stop")

    def __init__(self, max_tokens=None, logprobs=None, prompt_logprobs=None, **kwargs):
        self.max_tokens, self.logprobs, self.prompt_logprobs, self.extra = max_tokens, logprobs, prompt_logprobs, kwargs


import vllm  # noqa: E402  (the stub)

vllm.SamplingParams = SamplingParams


@dataclass
class Logprob:
    logprob: float
    rank: int
    decoded_token: str = ""


class FlatLogprobs:
    """vLLM 0.27.1's `vllm.logprobs.FlatLogprobs`, in what verl and the plugin use of it: flat lists per (position,
    entry), the sampled token first and then the top-K by rank (not de-duplicated), and the list-of-dicts view
    (`__len__`, `__getitem__` of a position, `__iter__`) through which verl reads `logprobs[token_ids[i]]`."""

    def __init__(self):
        self.start_indices, self.end_indices, self.token_ids, self.logprobs, self.ranks = [], [], [], [], []

    def append(self, entries):  # [(token id, Logprob)] of one position, in vLLM's order
        self.start_indices.append(len(self.logprobs))
        for token, entry in entries:
            self.token_ids.append(token)
            self.logprobs.append(entry.logprob)
            self.ranks.append(entry.rank)
        self.end_indices.append(len(self.logprobs))

    def __len__(self):
        return len(self.start_indices)

    def __getitem__(self, position):
        return {
            self.token_ids[i]: Logprob(self.logprobs[i], self.ranks[i])
            for i in range(self.start_indices[position], self.end_indices[position])
        }

    def __iter__(self):
        return (self[i] for i in range(len(self)))


VOCAB_TOP = [[5, 9, 2, 7, 1], [3, 4, 8, 6, 0], [11, 12, 13, 14, 15]]  # top-5 ids per position, by rank
SAMPLED = [9, 20, 11]  # inside, outside, inside the top-K


class Engine:
    def __init__(self):
        self.seen_logprobs = None

    async def generate(self, prompt, sampling_params, request_id, **kwargs):
        k = sampling_params.logprobs
        self.seen_logprobs = k
        self.seen_detokenize = sampling_params.extra.get("detokenize")
        self.seen_flat = sampling_params.extra.get("flat_logprobs")
        positions = FlatLogprobs() if self.seen_flat else []
        for top, sampled in zip(VOCAB_TOP, SAMPLED):
            entries = [
                (
                    sampled,
                    Logprob(
                        -3.0 if sampled not in top else -0.5 - top.index(sampled),
                        top.index(sampled) + 1 if sampled in top else 99,
                    ),
                )
            ]
            for rank, token in enumerate(top[: (k or 0)]):
                entries.append((token, Logprob(-0.5 - rank, rank + 1)))
            positions.append(entries if self.seen_flat else dict(entries))
        self.seen_layout = type(positions).__name__ if k is not None else None
        output = types.SimpleNamespace(
            token_ids=list(SAMPLED),
            logprobs=positions if k is not None else None,
            finish_reason="stop",
            routed_experts=None,
        )
        yield types.SimpleNamespace(outputs=[output], prompt_logprobs=None, num_cached_tokens=0)


import verl  # noqa: E402,F401  (loads the plugin: its import hook patches the server module below)
from omegaconf import OmegaConf  # noqa: E402

from verl.workers.rollout.vllm_rollout import vllm_async_server as server_module  # noqa: E402


def main(k: int, stop: str = "", logprobs: str = "1") -> dict:
    server = object.__new__(server_module.vLLMHttpServer)
    custom = {"dppo_topk": k} if k else {}
    server.config = OmegaConf.create(
        {
            "max_model_len": 64,
            "response_length": 8,
            "prompt_length": 8,
            "full_determinism": False,
            "enable_rollout_routing_replay": False,
            "mtp": None,
            "custom": custom,
            "logprobs_mode": "processed_logprobs",
        }
    )
    server.model_config = types.SimpleNamespace(processor=None, lora_rank=0, lora={})
    server.engine = Engine()
    server.replica_rank, server.global_steps, server._admitting = 0, 1, 0
    server._submission_paused, server._rejecting = False, False
    server._disaggregation_role, server._pd_decode_peers = None, None
    params = {"logprobs": logprobs != "0", "temperature": 1.0, **({"stop": [stop]} if stop else {})}
    result = asyncio.run(server.generate([1, 2, 3], params, "req-0"))
    extra = result.extra_fields
    return {
        "patched": bool(getattr(server_module.vLLMHttpServer.generate, "__verl_dppo_patched__", False)),
        "engine_logprobs": server.engine.seen_logprobs,
        "detokenize": server.engine.seen_detokenize,
        "flat_logprobs": server.engine.seen_flat,
        "layout": server.engine.seen_layout,
        "token_ids": list(result.token_ids),
        "log_probs": result.log_probs,
        "topk_ids": extra["dppo_topk_ids"].tolist() if "dppo_topk_ids" in extra else None,
        "topk_logprobs": extra["dppo_topk_logprobs"].tolist() if "dppo_topk_logprobs" in extra else None,
    }


if __name__ == "__main__":
    stubs.run_cases(lambda k, *rest: main(int(k), *rest), sys.argv[1:])
