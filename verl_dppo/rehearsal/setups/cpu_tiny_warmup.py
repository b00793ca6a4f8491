"""The cpu_tiny task: its GSM8K-shaped problems, and the model's warm start, a short supervised phase so that a CPU
run has something to learn from.

A random-init model never writes "#### <right answer>", so verl's GSM8K reward is 0 for every sample, every GRPO
advantage is 0 and the update moves nothing. As the demo does (verl_dppo/studies/demo/warmup.py, after the paper's sanity
test, Sec. 5: problems the initial model solves 20-80% of the time), the build teaches the model the task by
supervised steps on worked solutions and stops as soon as its sampled reward, scored by verl's own GSM8K verifier on
problems it was not trained on, reaches `target_reward`: RL then starts from a policy that solves about that share
of the problems, and the two samples of a prompt often disagree (non-zero advantages).

The prompts are the ones verl's agent loop sends (the data command's GSM8K conversion, then the tokenizer's chat
template with the generation prompt), the targets the synthetic rows' worked solutions followed by `<|im_end|>`.
Everything is seeded: the same settings give the same weights on the same machine.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

__all__ = [
    "ITEMS",
    "NAMES",
    "QUESTIONS",
    "WarmUp",
    "WarmUpResult",
    "chat_rows",
    "sampled_reward",
    "synthetic_problems",
    "warm_up",
]

NAMES = ("Ada", "Ben", "Cleo", "Dev", "Emma", "Finn", "Gus", "Hana", "Ivan", "Jade", "Kofi", "Lena")
ITEMS = ("apples", "books", "coins", "eggs", "marbles", "pencils", "stamps", "stickers")
# Operands: small enough that the warm start teaches the arithmetic in about a hundred steps.
_LOW, _HIGH = 2, 5
QUESTIONS = (
    (
        "{name} has {a} {item}. {name} buys {b} more {item}. How many {item} does {name} have now?",
        "{name} has {a} + {b} = {r} {item} now.",
        lambda a, b: a + b,
    ),
    (
        "{name} had {s} {item} and gave {b} of them to a friend. How many {item} does {name} have left?",
        "{name} has {s} - {b} = {r} {item} left.",
        lambda a, b: a,
    ),
    (
        "{name} buys {a} boxes with {b} {item} in each box. How many {item} does {name} buy?",
        "{name} buys {a} * {b} = {r} {item}.",
        lambda a, b: a * b,
    ),
    (
        "{name} shares {p} {item} equally among {b} friends. How many {item} does each friend get?",
        "Each friend gets {p} / {b} = {r} {item}.",
        lambda a, b: a,
    ),
)


def synthetic_problems(count: int, seed: int) -> list[dict]:
    """GSM8K-shaped rows (`question`, `answer` = worked solution ending in "#### <number>"), one-step word
    problems over a small fixed vocabulary."""
    rng = random.Random(seed)
    rows = []
    for index in range(count):
        question, solution, result = QUESTIONS[index % len(QUESTIONS)]
        a, b = rng.randint(_LOW, _HIGH), rng.randint(_LOW, _HIGH)
        fields = dict(name=rng.choice(NAMES), item=rng.choice(ITEMS), a=a, b=b, s=a + b, p=a * b, r=result(a, b))
        rows.append(
            {"question": question.format(**fields), "answer": solution.format(**fields) + f"\n#### {fields['r']}"}
        )
    return rows


@dataclass(frozen=True)
class WarmUp:
    """Recipe keys `dppo.tiny_model.warmup.*`; `max_steps: 0` leaves the model random (reward 0)."""

    target_reward: float = 0.5
    max_steps: int = 600
    batch_size: int = 32
    lr: float = 1e-2
    check_every: int = 20
    train_problems: int = 2048
    probe_problems: int = 64
    probe_samples: int = 2
    temperature: float = 1.0
    max_new_tokens: int = 16

    @classmethod
    def from_config(cls, node: Any) -> "WarmUp":
        if node is None:
            return cls()
        types = {key: type(getattr(cls(), key)) for key in cls.__dataclass_fields__}
        return cls(**{key: types[key](node[key]) for key in types if node.get(key) is not None})


@dataclass(frozen=True)
class WarmUpResult:
    steps: int
    reward: float
    """Mean sampled reward (verl's GSM8K verifier, `temperature`) on the probe problems when the phase stopped."""
    seconds: float


def chat_rows(tokenizer, problems: list[dict]) -> list[tuple[list[int], list[int], str]]:
    """(prompt ids, target ids, ground truth) per synthetic row: the prompt as the data command converts it and
    verl's agent loop renders it, the target its worked solution and `<|im_end|>`."""
    from verl_dppo.datasets import DATASETS, convert_rows

    converted = convert_rows(problems, DATASETS["gsm8k"], "cpu_tiny warm-up")
    if len(converted) != len(problems):  # convert_rows drops duplicates: keep rows and solutions paired
        by_prompt = {(row["prompt"][-1]["content"]): row for row in converted}
        converted = [by_prompt[DATASETS["gsm8k"].template.format(problem=p["question"].strip())] for p in problems]
    rows = []
    for source, row in zip(problems, converted):
        prompt = tokenizer.apply_chat_template(
            row["prompt"], add_generation_prompt=True, tokenize=True, return_dict=False
        )
        target = tokenizer.encode(source["answer"], add_special_tokens=False) + [tokenizer.eos_token_id]
        rows.append((list(prompt), target, str(row["reward_model"]["ground_truth"])))
    return rows


def _left_padded(sequences: list[list[int]], pad: int):
    import torch

    width = max(len(ids) for ids in sequences)
    ids = torch.full((len(sequences), width), pad, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for i, seq in enumerate(sequences):
        ids[i, width - len(seq) :] = torch.tensor(seq)
        mask[i, width - len(seq) :] = 1
    return ids, mask


def sampled_reward(
    model, tokenizer, rows, samples: int, temperature: float, max_new_tokens: int, seed: int
) -> list[float]:
    """verl's GSM8K score (strict "#### <number>") of `samples` responses per row, sampled at `temperature` (0:
    greedy) with the rollout's defaults otherwise (top_p 1, no top-k), decoded as verl's reward manager decodes."""
    import torch
    from verl.utils.reward_score.gsm8k import compute_score

    prompts = [prompt for prompt, _, _ in rows for _ in range(samples)]
    truths = [truth for _, _, truth in rows for _ in range(samples)]
    ids, mask = _left_padded(prompts, tokenizer.pad_token_id)
    was_training = model.training
    model.eval()
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        sampling = (
            dict(do_sample=True, temperature=temperature, top_p=1.0, top_k=0)
            if temperature > 0
            else dict(do_sample=False)
        )
        with torch.no_grad():
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=max_new_tokens,
                pad_token_id=tokenizer.pad_token_id,
                eos_token_id=tokenizer.eos_token_id,
                **sampling,
            )
    model.train(was_training)
    texts = tokenizer.batch_decode(out[:, ids.shape[1] :], skip_special_tokens=True)
    return [float(compute_score(text, truth)) for text, truth in zip(texts, truths)]


def warm_up(
    model,
    tokenizer,
    train: list[dict],
    probe: list[dict],
    settings: WarmUp,
    seed: int,
    progress: Optional[Callable[[int, float], None]] = None,
) -> WarmUpResult:
    """Supervised steps (AdamW, cross-entropy on the target tokens only) on rows of `train` until the mean sampled
    reward on `probe` (checked every `check_every` steps) reaches `settings.target_reward`. Raises RuntimeError if
    `max_steps` pass first."""
    import torch

    if settings.max_steps <= 0:
        return WarmUpResult(0, float("nan"), 0.0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one thread: the same float sums, so the same weights, on any machine with this torch
    try:
        return _supervised(model, tokenizer, train, probe, settings, seed, progress)
    finally:
        torch.set_num_threads(threads)


def _supervised(model, tokenizer, train, probe, settings: WarmUp, seed: int, progress) -> WarmUpResult:
    import torch

    start = time.perf_counter()
    train_rows, probe_rows = chat_rows(tokenizer, train), chat_rows(tokenizer, probe)
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=settings.lr, weight_decay=0.01)
    model.train()
    reward, step = 0.0, 0
    while step < settings.max_steps:
        batch = torch.randint(len(train_rows), (settings.batch_size,), generator=generator).tolist()
        sequences = [train_rows[i][0] + train_rows[i][1] for i in batch]
        ids, mask = _left_padded(sequences, tokenizer.pad_token_id)
        # The targets end every row (left padding): only their positions need logits, most of a step's compute.
        width = max(len(train_rows[i][1]) for i in batch)
        labels = ids[:, -width:].clone()
        for row, i in enumerate(batch):
            labels[row, : width - len(train_rows[i][1])] = -100
        positions = (mask.cumsum(dim=1) - 1).clamp(min=0)
        logits = model(input_ids=ids, attention_mask=mask, position_ids=positions, logits_to_keep=width + 1).logits
        loss = torch.nn.functional.cross_entropy(
            logits[:, :-1].flatten(0, 1).float(), labels.flatten(), ignore_index=-100
        )
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        step += 1
        if step % settings.check_every == 0:
            scores = sampled_reward(
                model,
                tokenizer,
                probe_rows,
                settings.probe_samples,
                settings.temperature,
                settings.max_new_tokens,
                seed + step,
            )
            reward = sum(scores) / len(scores)
            if progress is not None:
                progress(step, reward)
            if reward >= settings.target_reward:
                break
    if reward < settings.target_reward:
        raise RuntimeError(
            f"the cpu_tiny warm start reached a sampled reward of {reward:.2f} after {step} steps, below "
            f"dppo.tiny_model.warmup.target_reward={settings.target_reward}: raise dppo.tiny_model.warmup.max_steps"
        )
    model.eval()
    return WarmUpResult(step, reward, time.perf_counter() - start)
