"""One method's RL phase: rollout from the bf16 copy, verl's GRPO advantage, mini-batch updates via verl's ppo_loss.

Per step, mirroring verl's v1 trainer:
  1. sync the rollout engine, sample `samples_per_prompt` responses per prompt; mu = the engine's log-probs.
     With `rollout_lag` L the engine syncs from the weights of L steps ago (a stale rollout, `verl-dppo staleness`)
  2. reward, `compute_grpo_outcome_advantage` (verl)
  3. old_log_probs: the fp32 learner's recompute (verl's default, non-bypass flow); with it verl's own
     `calculate_debug_metrics` measures the pure training-inference mismatch (training/rollout_probs_diff_*).
     `bypass`: the rollout's log-probs instead (verl's bypass mode), except for an anchor="recompute" method
  4. `mini_batches` optimizer steps; each mini-batch is cut into micro-batches and every micro-batch's loss
     comes from `verl.workers.utils.losses.ppo_loss` (the plugin's wrapper) with a real `ActorConfig`
  5. one row in verl's file-logger format (verl.utils.tracking.Tracking, backend "file")
"""

from __future__ import annotations

import collections
import contextlib
import io
import os
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import numpy as np
import torch

import verl_dppo.studies.demo.task as task
from verl_dppo.studies.demo.hook_terms import to_no_padding, topk_statistics, troll_terms
from verl_dppo.studies.demo.methods import Method, actor_config
from verl_dppo.studies.demo.policy import RolloutEngine, build_policy, log_probs_from_logits, sequence_log_probs
from verl_dppo.studies.demo.settings import DemoSettings
from verl_dppo.studies.demo.warmup import WarmStart

PROB_BINS = np.linspace(0.0, 1.0, 21)
"""Bins of the rollout probability mu(a_t) for the blocked-token histogram."""


@dataclass
class BlockedTokens:
    """Counts by rollout-probability bin: tokens with a non-zero advantage, and those the method blocked."""

    updates: np.ndarray = field(default_factory=lambda: np.zeros(len(PROB_BINS) - 1, dtype=np.int64))
    blocked: np.ndarray = field(default_factory=lambda: np.zeros(len(PROB_BINS) - 1, dtype=np.int64))

    def add(self, mu_prob: torch.Tensor, has_update: torch.Tensor, blocked: torch.Tensor) -> None:
        self.updates += np.histogram(mu_prob[has_update].numpy(), PROB_BINS)[0]
        self.blocked += np.histogram(mu_prob[blocked].numpy(), PROB_BINS)[0]


def micro_batch(
    prompts,
    responses,
    response_mask,
    old_log_probs,
    rollout_log_probs,
    advantages,
    mini_batch_tokens: int,
    mini_batch_size: int,
    versions: Optional[tuple[int, int]] = None,
):
    """A TensorDict micro-batch as verl's engine hands it to ppo_loss (padded layout, global batch info set).

    versions = (trainer version, rollout version): attached as verl's async trainer does (the plugin's
    TRAINER_VERSION field and one `extra_fields` dict per sample with `min_global_steps`), for the lag metrics."""
    from tensordict import NonTensorStack, TensorDict
    from verl.utils import tensordict_utils as tu

    data = TensorDict(
        {
            "prompts": prompts,
            "responses": responses,
            "attention_mask": torch.cat([torch.ones_like(prompts), response_mask], dim=1),
            "response_mask": response_mask,
            "old_log_probs": old_log_probs,
            "rollout_log_probs": rollout_log_probs,
            "advantages": advantages,
        },
        batch_size=[prompts.shape[0]],
    )
    # What FSDPEngine.forward_backward_batch and the trainer attach: loss normalisers over the whole mini-batch.
    tu.assign_non_tensor(data, dp_size=1, batch_num_tokens=mini_batch_tokens, global_batch_size=mini_batch_size)
    if versions is not None:
        from verl_dppo.plugin.staleness import TRAINER_VERSION

        trainer, rollout = versions
        data.set(
            "extra_fields",
            NonTensorStack(
                *[{"min_global_steps": rollout, "max_global_steps": rollout} for _ in range(prompts.shape[0])]
            ),
        )
        tu.assign_non_tensor(data, **{TRAINER_VERSION: trainer})
    return data


def _scalar(value) -> float:
    return float(value.item() if hasattr(value, "item") else value)


def validate(engine: RolloutEngine, problems: np.ndarray) -> dict[str, float]:
    """Greedy accuracy on held-out problems, named as verl names its core validation metric."""
    responses, _ = engine.generate(task.encode_prompts(problems), temperature=0.0)
    accuracy = task.rewards(responses, problems).mean().item()
    return {f"val-core/{task.DATA_SOURCE}/acc/mean@1": accuracy}


def train_method(
    method: Method,
    settings: DemoSettings,
    warm: WarmStart,
    out_dir: str,
    on_step: Optional[Callable[[int, float], None]] = None,
    run_name: Optional[str] = None,
) -> dict:
    """Run one method's RL phase; write `<out_dir>/<run_name or method.name>.jsonl`; return its summary."""
    import verl  # noqa: F401  (loads the plugin: loss modes registered, ppo_loss wrapped)
    import verl.workers.utils.losses as verl_losses
    from verl import DataProto
    from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage
    from verl.utils.debug.metrics import calculate_debug_metrics
    from verl.utils.metric import Metric, reduce_metrics
    from verl.utils.tracking import Tracking

    from verl_dppo.plugin.modes import logits_hook

    if not getattr(verl_losses.ppo_loss, "__verl_dppo_wrapped__", False):
        raise RuntimeError("verl's ppo_loss is not the verl-dppo wrapper after `import verl`: run `verl-dppo doctor`")
    start = time.perf_counter()
    n_seq = settings.prompts_per_step * settings.samples_per_prompt
    config = actor_config(
        method,
        settings.prompts_per_step,
        settings.samples_per_prompt,
        settings.mini_batches,
        settings.micro_batch_size,
        settings.lr,
        settings.grad_clip,
    )
    mini_size = n_seq // settings.mini_batches

    policy = build_policy(settings.seed, settings.hidden_size, settings.num_layers)
    policy.load_state_dict(warm.policy_state)
    engine = RolloutEngine(policy, settings.rollout_precision)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=settings.lr, weight_decay=config.optim.weight_decay)
    # The last rollout_lag + 1 versions of the weights (CPU copies); versions[0] is what the stale rollout samples.
    versions: collections.deque = collections.deque(maxlen=settings.rollout_lag + 1)
    # verl's bypass mode: old_log_probs are the rollout's, unless the method anchors on the learner's recompute.
    bypass = settings.bypass and method.policy_loss.get("anchor", "rollout") != "recompute"

    run_name = run_name or method.name
    # verl's FileLogger reads its path from the environment when it is built: set for that moment only, so that a
    # process that runs the demo in-process (the tests) keeps its own environment.
    saved = os.environ.get("VERL_FILE_LOGGER_PATH")
    os.environ["VERL_FILE_LOGGER_PATH"] = os.path.join(out_dir, f"{run_name}.jsonl")
    try:
        with contextlib.redirect_stdout(io.StringIO()):  # FileLogger announces its path on stdout
            tracker = Tracking("verl_dppo_demo", run_name, default_backend=["file"])
    finally:
        if saved is None:
            os.environ.pop("VERL_FILE_LOGGER_PATH", None)
        else:
            os.environ["VERL_FILE_LOGGER_PATH"] = saved
    blocked_tokens = BlockedTokens()
    scores, clipfracs, held_out = [], [], []
    val_key = f"val-core/{task.DATA_SOURCE}/acc/mean@1"
    try:
        start_row = validate(engine, warm.val_problems)
        tracker.log(data=start_row, step=0)
        held_out.append([0, start_row[val_key]])
        for step in range(1, settings.steps + 1):
            step_start = time.perf_counter()
            # Same prompts and the same sampling noise at step s for every method: differences come from pi only.
            rng = np.random.default_rng([settings.seed, step])
            digits = warm.train_problems[rng.choice(len(warm.train_problems), settings.prompts_per_step, False)]
            digits = np.repeat(digits, settings.samples_per_prompt, axis=0)
            uid = np.repeat(np.arange(settings.prompts_per_step), settings.samples_per_prompt)
            prompts = task.encode_prompts(digits)
            if settings.rollout_lag:
                versions.append({name: value.detach().clone() for name, value in policy.state_dict().items()})
                engine.sync_state(versions[0])  # version max(0, step - 1 - rollout_lag)
            else:
                engine.sync(policy)
            trainer_version, rollout_version = step - 1, max(0, step - 1 - settings.rollout_lag)
            generator = torch.Generator().manual_seed(settings.seed * 1_000_003 + step)
            k = method.policy_loss.get("topk", 0) if method.needs_rollout_topk else 0
            responses, rollout_log_probs, topk_ids, topk_log_probs = engine.generate_with_topk(
                prompts, settings.temperature, generator, k
            )
            gen_s = time.perf_counter() - step_start

            response_mask = task.response_mask(responses)
            score = task.rewards(responses, digits)
            lengths = response_mask.sum(dim=1)
            token_level_rewards = torch.zeros(n_seq, task.RESPONSE_LEN)
            token_level_rewards[torch.arange(n_seq), lengths - 1] = score
            advantages, returns = compute_grpo_outcome_advantage(
                token_level_rewards=token_level_rewards, response_mask=response_mask, index=uid
            )
            input_ids = torch.cat([prompts, responses], dim=1)
            attention_mask = torch.cat([torch.ones_like(prompts), response_mask], dim=1)
            with torch.no_grad():
                full_log_probs, full_entropy = sequence_log_probs(policy, input_ids, attention_mask, with_entropy=True)
            response_cols = slice(task.PROMPT_LEN - 1, task.PROMPT_LEN - 1 + task.RESPONSE_LEN)
            recomputed = full_log_probs[:, response_cols] * response_mask
            old_log_probs = rollout_log_probs if bypass else recomputed
            old_entropy = full_entropy[:, response_cols]
            mismatch = calculate_debug_metrics(
                DataProto.from_dict(
                    tensors={
                        "rollout_log_probs": rollout_log_probs,
                        "old_log_probs": recomputed,
                        "response_mask": response_mask,
                        "responses": responses,
                    }
                )
            )

            update_start = time.perf_counter()
            actor_metrics: dict[str, list] = {}
            grad_norms = []
            for first in range(0, n_seq, mini_size):
                mini = slice(first, first + mini_size)
                mini_tokens = int(response_mask[mini].sum())
                mini_metrics: dict[str, Metric] = {}
                for micro_first in range(first, first + mini_size, settings.micro_batch_size):
                    rows = slice(micro_first, micro_first + settings.micro_batch_size)
                    data = micro_batch(
                        prompts[rows],
                        responses[rows],
                        response_mask[rows],
                        old_log_probs[rows],
                        rollout_log_probs[rows],
                        advantages[rows],
                        mini_tokens,
                        mini_size,
                        (trainer_version, rollout_version) if settings.version_fields else None,
                    )
                    logits = policy(
                        input_ids=input_ids[rows], attention_mask=attention_mask[rows], use_cache=False
                    ).logits.float()
                    log_probs, entropy = log_probs_from_logits(logits, input_ids[rows], with_entropy=True)
                    log_probs.retain_grad()
                    log_probs_nnz = to_no_padding(log_probs, attention_mask[rows])
                    model_output = {"log_probs": log_probs_nnz, "entropy": to_no_padding(entropy, attention_mask[rows])}
                    if logits_hook(method.loss_mode) == "troll":  # TROLL's terms from the logits
                        model_output.update(
                            troll_terms(
                                config,
                                logits,
                                responses[rows],
                                response_mask[rows],
                                rollout_log_probs[rows],
                                topk_ids[rows],
                                topk_log_probs[rows],
                                attention_mask[rows],
                            )
                        )
                    elif topk_ids is not None:
                        model_output.update(
                            topk_statistics(
                                logits.detach(),
                                responses[rows],
                                response_mask[rows],
                                rollout_log_probs[rows],
                                topk_ids[rows],
                                topk_log_probs[rows],
                                attention_mask[rows],
                            )
                        )
                    loss, metrics = verl_losses.ppo_loss(config, model_output, data)
                    loss.backward()
                    for name, metric in metrics.items():
                        if isinstance(metric, Metric):
                            mini_metrics.setdefault(name, metric.init_list()).extend(metric)
                    # A token the loss masked (M_t = 0) gets exactly zero gradient even though A_t != 0.
                    # TROLL's gradient reaches the logits through its projection, not through log pi: it masks nothing.
                    has_update = response_mask[rows].bool() & (advantages[rows] != 0)
                    blocked = (
                        has_update & (log_probs.grad[:, response_cols] == 0)
                        if log_probs.grad is not None
                        else torch.zeros_like(has_update)
                    )
                    blocked_tokens.add(rollout_log_probs[rows].exp(), has_update, blocked)
                grad_norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), settings.grad_clip)
                if not torch.isfinite(grad_norm):
                    raise FloatingPointError(f"{method.name}: non-finite gradient norm at step {step}")
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                grad_norms.append(grad_norm.item())
                for name, metric in mini_metrics.items():
                    actor_metrics.setdefault(name, []).append(metric.aggregate())
            actor = reduce_metrics(actor_metrics)
            update_s = time.perf_counter() - update_start

            valid_adv = advantages[response_mask.bool()]
            row = {
                "training/global_step": step,
                "training/epoch": 0,
                **{name: _scalar(value) for name, value in actor.items()},
                "actor/entropy": float((old_entropy * response_mask).sum() / response_mask.sum()),
                "actor/grad_norm": float(np.mean(grad_norms)),
                "actor/lr": settings.lr,
                "critic/score/mean": score.mean().item(),
                "critic/score/max": score.max().item(),
                "critic/score/min": score.min().item(),
                "critic/rewards/mean": score.mean().item(),
                "critic/rewards/max": score.max().item(),
                "critic/rewards/min": score.min().item(),
                "critic/advantages/mean": valid_adv.mean().item(),
                "critic/advantages/max": valid_adv.max().item(),
                "critic/advantages/min": valid_adv.min().item(),
                "critic/returns/mean": returns[response_mask.bool()].mean().item(),
                "response_length/mean": lengths.float().mean().item(),
                "response_length/max": lengths.max().item(),
                "response_length/min": lengths.min().item(),
                "response_length/clip_ratio": (lengths == task.RESPONSE_LEN).float().mean().item(),
                "prompt_length/mean": float(task.PROMPT_LEN),
                **{name: _scalar(value) for name, value in mismatch.items()},
            }
            if step % settings.val_every == 0 or step == settings.steps:
                engine.sync(policy)
                row.update(validate(engine, warm.val_problems))
                held_out.append([step, row[val_key]])
            row["timing_s/gen"] = gen_s
            row["timing_s/update_actor"] = update_s
            row["timing_s/step"] = time.perf_counter() - step_start
            tracker.log(data=row, step=step)
            scores.append(row["critic/score/mean"])
            clipfracs.append(row["actor/pg_clipfrac"])
            if on_step is not None:
                on_step(step, row["critic/score/mean"])
    finally:
        tracker.finish()
    return summarize(method, settings, warm, scores, clipfracs, blocked_tokens, time.perf_counter() - start, held_out)


def summarize(
    method,
    settings,
    warm,
    scores,
    clipfracs,
    blocked_tokens: BlockedTokens,
    seconds: float,
    held_out: Optional[list] = None,
) -> dict:
    """The final-table row: reward over the last tenth of the run, collapse verdict, masked fraction, held-out
    accuracy ([step, greedy accuracy] at each validation), time."""
    tail = max(10, len(scores) // 10)
    final = float(np.mean(scores[-tail:])) if scores else float("nan")
    window = min(COLLAPSE_WINDOW, len(scores))
    lowest = float(np.convolve(scores, np.ones(window) / window, "valid").min()) if scores else float("nan")
    return {
        "method": method.name,
        "seed": settings.seed,
        "description": method.description,
        "final_reward": final,
        "final_window": min(tail, len(scores)),
        "initial_reward": warm.train_success_rate,
        "best_reward": float(np.max(scores)) if scores else float("nan"),
        "lowest_window_reward": lowest,
        "collapse_window": window,
        "collapsed": bool(lowest < COLLAPSE_FRACTION * warm.train_success_rate),
        "masked_frac": float(np.mean(clipfracs)) if clipfracs else float("nan"),
        "seconds": seconds,
        "steps": len(scores),
        "blocked_by_prob": blocked_tokens.blocked.tolist(),
        "updates_by_prob": blocked_tokens.updates.tolist(),
        "prob_bins": PROB_BINS.tolist(),
        "held_out_accuracy": held_out or [],
        "n_held_out": len(warm.val_problems),
    }


COLLAPSE_FRACTION = 0.5
COLLAPSE_WINDOW = 20
"""A run "collapsed" when its training reward, averaged over some COLLAPSE_WINDOW consecutive steps, fell below
COLLAPSE_FRACTION of the warm-started success rate (it may partly recover later: the table shows both)."""
