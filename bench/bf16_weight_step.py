"""What of the real model's first optimizer step reaches a bf16 copy of its weights, as vLLM in bf16 holds them: the
cause of the mismatch that grew after the first update in the smollm2 launches until the setup's build rounded the
weights to bf16 values (docs/real-model.md).

    .venv/bin/python bench/bf16_weight_step.py            # lr 1e-6 (the setup's), 8 sums, 48 sampled tokens each

The model is the setup's SmolLM2-135M-Instruct, read from the package's GGUF file as the setup's build reads it: the
Q4_1 de-quantisation in float32, which the build then rounds to bf16 values (`--bf16-checkpoint` does the same here;
without it, the weights as the build wrote them before 2026-11-29). The trainer keeps float32 weights; vLLM in bf16
rounds each pushed weight to the nearest bf16 value. One step of Adam from a fresh state moves each weight by
lr * g / (|g| + eps) against its loss's gradient g (weight decay aside: lr * 0.01 * |w|, a hundred times smaller at
these weights), whatever the loss; here the step ascends the sampled tokens' mean log-prob on the setup's sums
(sampled by the float32 model at temperature 1), so it is coherent as a training step is, not random. Printed:

- the weights: the share that are bf16 values exactly and the share halfway between two bf16 values (round to nearest
  even keeps such a weight's even neighbour, and any step towards the other, however small, moves the copy by a whole
  bf16 spacing), the mean rounding error |bf16(w) - w| before and after the step, and the share of the step that the
  bf16 copy moves by, <bf16(w + s) - bf16(w), s> / <s, s>, over all weights, the exact ones, the halfway ones and the
  others;
- the sampled tokens' log-probs, all computed in float32 so that only the weights differ: the trainer's before (w) and
  after (w + s), the bf16 copy's before and after; their mean absolute differences (the copy's mismatch before and
  after the step, the trainer's policy change, the change the copy sees), the mismatch that the exact weights' part
  of the step alone makes (the trainer at w + s against w + s without the exact weights' part), and the change that
  the halfway weights' copies alone make (w with those weights replaced by their bf16 copy after the step, against w).

`--bf16-checkpoint` starts from the weights rounded to bf16, as the build writes them and as a published bf16
checkpoint's are.

vLLM also computes in bf16, which this leaves out: the launches' mismatch at step 1 includes that, this bench's does
not. Prints one JSON line at the end.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lr", type=float, default=1e-6, help="the setup's actor lr")
    parser.add_argument("--eps", type=float, default=1e-8, help="Adam's eps (torch's and verl's default)")
    parser.add_argument("--sums", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--bf16-checkpoint",
        action="store_true",
        help="start from the weights rounded to bf16, as the setup's build and a published bf16 checkpoint have them",
    )
    args = parser.parse_args()

    import pyarrow.parquet as pq
    from torch.func import functional_call
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from verl_dppo.rehearsal.setups.real_model import gguf_file, write_arithmetic

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    start = time.perf_counter()
    source = gguf_file()
    with tempfile.TemporaryDirectory() as folder:
        rows = pq.read_table(write_arithmetic(Path(folder), 64, 0)).to_pylist()[: args.sums]
    tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:  # SmolLM2's tokenizer has none: pad with its end of text, masked out
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name, dtype=torch.float32).eval()

    texts = [tokenizer.apply_chat_template(row["prompt"], tokenize=False, add_generation_prompt=True) for row in rows]
    encoded = tokenizer(texts, return_tensors="pt", padding=True)
    with torch.no_grad():
        ids = model.generate(
            **encoded,
            do_sample=True,
            temperature=1.0,
            top_p=1.0,
            top_k=0,
            max_new_tokens=args.max_new_tokens,
            pad_token_id=tokenizer.pad_token_id,
        )
    prompt_len = encoded["input_ids"].shape[1]
    attention = torch.cat([encoded["attention_mask"], torch.ones_like(ids[:, prompt_len:])], dim=1)
    response = torch.zeros_like(ids, dtype=torch.bool)
    response[:, prompt_len:] = True
    # the sampled tokens up to and including each row's first end of text
    ended = (ids[:, prompt_len:] == tokenizer.eos_token_id).long().cumsum(dim=1)
    response[:, prompt_len:] &= (ended - (ids[:, prompt_len:] == tokenizer.eos_token_id).long()) == 0
    target = response[:, 1:]

    def logprobs(weights: dict) -> torch.Tensor:
        logits = functional_call(model, weights, args=(), kwargs={"input_ids": ids, "attention_mask": attention}).logits
        picked = torch.log_softmax(logits[:, :-1].float(), dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        return picked[target]

    names = dict(model.named_parameters())
    if args.bf16_checkpoint:
        with torch.no_grad():
            for p in names.values():
                p.copy_(p.bfloat16().float())
    model.zero_grad()
    logprobs(names).mean().backward()  # ascend the sampled tokens' log-prob: a coherent step as a training step's
    w = {name: p.detach().clone() for name, p in names.items()}
    step = {name: args.lr * p.grad / (p.grad.abs() + args.eps) for name, p in names.items()}
    after = {name: w[name] + step[name] for name in w}
    copy = {name: t.bfloat16().float() for name, t in w.items()}
    copy_after = {name: t.bfloat16().float() for name, t in after.items()}
    exact = {name: copy[name] == t for name, t in w.items()}
    # halfway between two bf16 values: round-to-nearest-even keeps the even one, and any step towards the other,
    # however small, moves the copy by a whole bf16 spacing (2^(e - 7) for a weight in [2^e, 2^(e + 1)))
    tie = {
        name: (t - copy[name]).abs() == torch.ldexp(torch.ones_like(t), torch.frexp(t).exponent - 9)
        for name, t in w.items()
    }

    count = sum(t.numel() for t in w.values())
    n_exact = sum(int(m.sum()) for m in exact.values())
    n_tie = sum(int(m.sum()) for m in tie.values())

    def share(mask_of) -> float:
        moved = sum(float(((copy_after[n] - copy[n]) * step[n])[mask_of(n)].double().sum()) for n in w)
        total = sum(float((step[n] * step[n])[mask_of(n)].double().sum()) for n in w)
        return moved / total if total else float("nan")

    def rounding(weights: dict) -> float:
        return sum(float((t.bfloat16().float() - t).abs().double().sum()) for t in weights.values()) / count

    with torch.no_grad():
        trainer, trainer_after = logprobs(w), logprobs(after)
        bf16, bf16_after = logprobs(copy), logprobs(copy_after)
        without_exact = logprobs({n: w[n] + step[n] * (~exact[n]) for n in w})
        ties_moved = logprobs({n: torch.where(tie[n], copy_after[n], w[n]) for n in w})

    def gap(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a - b).abs().mean())

    result = {
        "lr": args.lr,
        "weights": count,
        "tokens": int(target.sum()),
        "bf16_checkpoint": args.bf16_checkpoint,
        "exact_bf16_share": n_exact / count,
        "tie_share": n_tie / count,
        "rounding_before": rounding(w),
        "rounding_after": rounding(after),
        "step_reaching_bf16": share(lambda n: slice(None)),
        "step_reaching_bf16_exact": share(lambda n: exact[n]),
        "step_reaching_bf16_other": share(lambda n: ~exact[n] & ~tie[n]),
        "step_reaching_bf16_ties": share(lambda n: tie[n]),
        "mismatch_before": gap(trainer, bf16),
        "mismatch_after": gap(trainer_after, bf16_after),
        "trainer_change": gap(trainer_after, trainer),
        "bf16_change": gap(bf16_after, bf16),
        "exact_part_alone": gap(trainer_after, without_exact),
        "ties_alone": gap(ties_moved, trainer),
        "seconds": round(time.perf_counter() - start, 1),
    }
    print(
        f"{count:,} weights, {100 * result['exact_bf16_share']:.1f}% bf16 values exactly, "
        f"{100 * result['tie_share']:.1f}% halfway between two; mean |bf16(w) - w| "
        f"{result['rounding_before']:.4e} before, {result['rounding_after']:.4e} after a step of lr {args.lr:g}"
    )
    print(
        f"share of the step the bf16 copy moves by: {result['step_reaching_bf16']:.3f} over all weights, "
        f"{result['step_reaching_bf16_exact']:.3f} over the exact ones, {result['step_reaching_bf16_ties']:.1f} "
        f"over the halfway ones, {result['step_reaching_bf16_other']:.3f} over the others"
    )
    print(
        f"mean |log-prob difference| on {result['tokens']} sampled tokens (float32 compute): bf16 copy vs trainer "
        f"{result['mismatch_before']:.4e} before, {result['mismatch_after']:.4e} after; the trainer's change "
        f"{result['trainer_change']:.4e}, the copy's {result['bf16_change']:.4e}; the exact weights' part of the "
        f"step alone {result['exact_part_alone']:.4e}; the halfway weights' moves alone (their bf16 copy after the "
        f"step, the rest as before) {result['ties_alone']:.4e}"
    )
    print(json.dumps({key: None if value != value else value for key, value in result.items()}))  # NaN: null
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
