"""Warm start: a short supervised phase, then the sanity set (problems solved 20-80% of the time).

The paper's sanity test (Sec. 5) trains on problems the initial model solves 20-80% of the time, so a stable
method should approach 100% training reward. Here the "initial model" is made in-process: a random-init LM is
taught the task by supervised steps until its sampled accuracy on a probe set reaches `target_accuracy`, and the
problems whose per-problem success rate (out of `probe_samples` rollouts) falls in `band` become the RL set.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

import verl_dppo.studies.demo.task as task
from verl_dppo.studies.demo.policy import RolloutEngine, build_policy, sequence_log_probs


@dataclass
class WarmStart:
    policy_state: dict
    """state_dict of the warm-started fp32 policy."""
    train_problems: np.ndarray
    """[n, 4] digits: the sanity set the RL phase trains on."""
    val_problems: np.ndarray
    """[n, 4] digits: the held-out set for greedy validation (val-core/digit_sum/acc/mean@1): the `n_val` problems
    set aside before the warm-up, then every other problem that no supervised batch drew and that neither the probe
    set (the warm-up's stopping rule) nor the sanity-set screening used. No gradient and no choice saw one of them."""
    supervised_steps: int
    probe_accuracy: float
    """Sampled accuracy (temperature 1, rollout engine) on the probe set when the supervised phase stopped."""
    train_success_rate: float
    """Mean per-problem success rate of the kept sanity set, measured with `probe_samples` rollouts each."""
    seconds: float


def sampled_success(engine: RolloutEngine, digits: np.ndarray, samples: int, generator: torch.Generator) -> np.ndarray:
    """Per-problem success rate over `samples` rollouts at temperature 1: [n] floats in [0, 1]."""
    prompts = task.encode_prompts(np.repeat(digits, samples, axis=0))
    responses, _ = engine.generate(prompts, temperature=1.0, generator=generator)
    solved = task.rewards(responses, np.repeat(digits, samples, axis=0))
    return solved.view(len(digits), samples).mean(dim=1).numpy()


def warm_start(
    seed: int,
    hidden_size: int = 64,
    num_layers: int = 2,
    rollout_precision: str = "bf16-emulated",
    target_accuracy: float = 0.5,
    max_supervised_steps: int = 600,
    batch_size: int = 64,
    lr: float = 3e-3,
    check_every: int = 10,
    n_train: int = 256,
    n_val: int = 256,
    n_candidates: int = 1024,
    probe_samples: int = 16,
    band: tuple[float, float] = (0.2, 0.8),
    progress=None,
) -> WarmStart:
    import time

    start = time.perf_counter()
    rng = np.random.default_rng(seed)
    generator = torch.Generator().manual_seed(seed)
    problems = task.all_problems()[rng.permutation(10**task.N_DIGITS)]
    val_problems, pool = problems[:n_val], problems[n_val:]
    probe = pool[:256]

    policy = build_policy(seed, hidden_size, num_layers)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=lr, weight_decay=0.01)
    engine = RolloutEngine(policy, rollout_precision)
    accuracy, step = 0.0, 0
    drawn = np.zeros(len(pool), dtype=bool)
    while step < max_supervised_steps:
        batch = rng.integers(0, len(pool), size=batch_size)
        drawn[batch] = True
        digits = pool[batch]
        input_ids = torch.cat([task.encode_prompts(digits), task.answers(digits)], dim=1)
        log_probs, _ = sequence_log_probs(policy, input_ids, torch.ones_like(input_ids))
        # Column i holds log p(token i+1): the answer tokens sit at columns PROMPT_LEN-1 .. end-1.
        loss = -log_probs[:, task.PROMPT_LEN - 1 : -1].mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
        optimizer.step()
        step += 1
        if step % check_every == 0:
            engine.sync(policy)
            accuracy = float(sampled_success(engine, probe, 1, generator).mean())
            if progress is not None:
                progress(step, accuracy)
            if accuracy >= target_accuracy:
                break
    if accuracy < target_accuracy:
        raise RuntimeError(
            f"the supervised warm-up reached a sampled accuracy of {accuracy:.2f} after {step} steps, below the "
            f"target {target_accuracy:.2f}: raise --warmup-max-steps or lower --warmup-target"
        )

    engine.sync(policy)
    candidates = pool[256 : 256 + n_candidates]
    success = sampled_success(engine, candidates, probe_samples, generator)
    in_band = (success >= band[0]) & (success <= band[1])
    keep = np.flatnonzero(in_band)[:n_train]
    if len(keep) < min(n_train, 16):
        raise RuntimeError(
            f"only {len(keep)} of {n_candidates} candidate problems are solved {band[0]:.0%}-{band[1]:.0%} of the "
            "time after the warm-up; change --warmup-target"
        )
    # A larger held-out set without changing any draw above: the RL runs and their training rewards stay as they
    # were, and 256 problems alone gave a +-0.03 binomial error on a greedy accuracy.
    unseen = ~drawn
    unseen[: 256 + n_candidates] = False  # the probe set (the stopping rule) and the screened candidates
    return WarmStart(
        policy_state={name: tensor.clone() for name, tensor in policy.state_dict().items()},
        train_problems=candidates[keep],
        val_problems=np.concatenate([val_problems, pool[unseen]]),
        supervised_steps=step,
        probe_accuracy=accuracy,
        train_success_rate=float(success[keep].mean()),
        seconds=time.perf_counter() - start,
    )
