"""How often the smollm2 setup's task gives GRPO something to learn from: the real model's reward rate per sum, and how
often a group of n samples all agree (all right or all wrong: GRPO's advantages are then zero for the group).

    .venv/bin/python bench/real_model_task.py                  # the setup's 64 sums, 8 samples each, bf16, T=1

The model is the setup's (SmolLM2-135M-Instruct, built once under $DPPO_ROOT/models as a launch builds it), the sums are
the setup's (`write_arithmetic`, 64 problems, seed 0), each asked through the model's chat template as verl's dataset
does, sampled by transformers in bf16 at temperature 1 (the rollout's dtype and temperature; vLLM's kernels differ a
little), up to 64 new tokens, rewarded by the plugin's `last_number`. From c right of K samples of one sum, the chance
that a group of n agrees is estimated without bias: (C(c, n) + C(K - c, n)) / C(K, n). A step of the setup draws 4 sums:
all 4 groups agree with about the fourth power of the mean (sums drawn independently), and such a step has
advantages of zero. Prints one JSON line at the end.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from math import comb
from pathlib import Path

import torch


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--group", type=int, default=4, help="the rollout's n")
    parser.add_argument("--prompts-per-step", type=int, default=4, help="the setup's train_batch_size")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    if args.samples < args.group:
        parser.error("--samples must be at least --group")

    import pyarrow.parquet as pq
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from verl_dppo.rehearsal.setups.real_model import build_real_model, write_arithmetic
    from verl_dppo.plugin.rewards import last_number

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    path, did = build_real_model()
    if did:
        print(did, flush=True)
    with tempfile.TemporaryDirectory() as folder:
        rows = pq.read_table(write_arithmetic(Path(folder), 64, 0)).to_pylist()
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:  # SmolLM2's tokenizer has none: pad with its end of text, masked out
        tokenizer.pad_token = tokenizer.eos_token
    pad = tokenizer.pad_token_id
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()

    start, right, lengths = time.perf_counter(), [], []
    for first in range(0, len(rows), 16):
        batch = rows[first : first + 16]
        texts = [
            tokenizer.apply_chat_template(row["prompt"], tokenize=False, add_generation_prompt=True) for row in batch
        ]
        encoded = tokenizer(texts, return_tensors="pt", padding=True)
        with torch.no_grad():
            out = model.generate(
                **encoded,
                do_sample=True,
                temperature=args.temperature,
                top_p=1.0,
                top_k=0,
                max_new_tokens=args.max_new_tokens,
                num_return_sequences=args.samples,
                pad_token_id=pad,
            )
        generated = out[:, encoded["input_ids"].shape[1] :]
        for index, row in enumerate(batch):
            count = 0
            for sample in generated[index * args.samples : (index + 1) * args.samples]:
                text = tokenizer.decode(sample, skip_special_tokens=True)
                count += int(last_number("", text, row["reward_model"]["ground_truth"]))
                lengths.append(int(sample.ne(pad).sum()))
            right.append(count)
        print(f"{first + len(batch)}/{len(rows)} sums, {time.perf_counter() - start:.0f} s", flush=True)

    k, n = args.samples, args.group
    agree = [(comb(c, n) + comb(k - c, n)) / comb(k, n) for c in right]
    mean_agree = sum(agree) / len(agree)
    result = {
        "sums": len(rows),
        "samples": k,
        "temperature": args.temperature,
        "max_new_tokens": args.max_new_tokens,
        "reward_rate": sum(right) / (k * len(right)),
        "sums_never_right": sum(c == 0 for c in right) / len(right),
        "sums_always_right": sum(c == k for c in right) / len(right),
        "group_agrees": mean_agree,
        "step_all_groups_agree": mean_agree**args.prompts_per_step,
        "mean_response_tokens": sum(lengths) / len(lengths),
        "seconds": round(time.perf_counter() - start, 1),
    }
    print(
        f"reward rate {result['reward_rate']:.3f}; sums never right in {k} samples {result['sums_never_right']:.2f}, "
        f"always right {result['sums_always_right']:.2f}; a group of {n} agrees {mean_agree:.3f}; a step's "
        f"{args.prompts_per_step} groups all agree ~{result['step_all_groups_agree']:.3f}"
    )
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
