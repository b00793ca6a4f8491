"""Run verl 0.9.1's real `SGLangHttpServer.generate` (unmodified) against a stand-in SGLang tokenizer manager, with
the plugin's Top-K patch installed by the import hook; print what the server returns, as JSON.

The tokenizer manager answers like SGLang's non-streaming `generate_request`: meta_info with
`output_token_logprobs` [(logprob, id, text)] and, when `top_logprobs_num` was asked, `output_top_logprobs`
(per token, the top entries most likely first). Usage: python sglang_server.py K [ROLE]  (K = 0: no Top-K; ROLE:
the server's prefill/decode disaggregation role, "prefill" or "decode", called as verl calls that leg: with a
bootstrap room; the sampling temperature from PROBE_TEMPERATURE, 1.0 unset), or python sglang_server.py --cases JSON:
a list of such argument lists, each with an optional environment of its own (stubs.run_cases), in this one process.
"""

import asyncio
import os
import sys
import types

sys.path.insert(0, os.path.dirname(__file__))
import stubs  # noqa: E402

stubs.install("sglang")


class GenerateReqInput:
    def __init__(self, **kwargs):
        self.__dict__.update(kwargs)


import sglang.srt.managers.io_struct as io_struct  # noqa: E402  (the stub)

io_struct.GenerateReqInput = GenerateReqInput

TOP = [[5, 9, 2, 7, 1], [3, 4, 8, 6, 0], [11, 12, 13, 14, 15]]
SAMPLED = [9, 20, 11]


class TokenizerManager:
    def __init__(self):
        self.request = None

    async def generate_request(self, request, raw_request):
        self.request = request
        sampled_lp = [-1.5, -3.0, -0.5]
        meta = {
            "finish_reason": {"type": "stop"},
            "output_token_logprobs": [(lp, t, None) for lp, t in zip(sampled_lp, SAMPLED)],
        }
        k = getattr(request, "top_logprobs_num", None)
        if k:
            meta["output_top_logprobs"] = [[(-0.5 - r, t, None) for r, t in enumerate(top[:k])] for top in TOP]
        yield {"output_ids": list(SAMPLED), "meta_info": meta}


import verl  # noqa: E402,F401  (loads the plugin: its import hook patches the server module below)
from omegaconf import OmegaConf  # noqa: E402

from verl.workers.rollout.sglang_rollout import async_sglang_server as server_module  # noqa: E402


def main(k: int, role: str = "") -> dict:
    server = object.__new__(server_module.SGLangHttpServer)
    server.config = OmegaConf.create(
        {
            "max_model_len": 64,
            "response_length": 8,
            "prompt_length": 8,
            "enable_rollout_routing_replay": False,
            "mtp": None,
            "custom": {"dppo_topk": k} if k else {},
            "skip_tokenizer_init": True,
        }
    )
    server.model_config = types.SimpleNamespace(processor=None, lora_rank=0, lora={})
    server.tokenizer_manager = TokenizerManager()
    server.replica_rank, server.global_steps = 0, 1
    server._disaggregation_role, server._pd_decode_peers = role or None, None
    legs = {"bootstrap_host": "10.0.0.1", "bootstrap_port": 8998, "bootstrap_room": 12345} if role else {}
    temperature = float(os.environ.get("PROBE_TEMPERATURE", "1.0"))
    result = asyncio.run(server.generate([1, 2, 3], {"logprobs": True, "temperature": temperature}, "req-0", **legs))
    extra = result.extra_fields
    request = server.tokenizer_manager.request
    return {
        "patched": bool(getattr(server_module.SGLangHttpServer.generate, "__verl_dppo_patched__", False)),
        "top_logprobs_num": getattr(request, "top_logprobs_num", None),
        "token_ids": list(result.token_ids),
        "log_probs": result.log_probs,
        "topk_ids": extra["dppo_topk_ids"].tolist() if "dppo_topk_ids" in extra else None,
        "topk_logprobs": extra["dppo_topk_logprobs"].tolist() if "dppo_topk_logprobs" in extra else None,
    }


if __name__ == "__main__":
    stubs.run_cases(lambda k, *rest: main(int(k), *rest), sys.argv[1:])
