"""Staleness diagnostics: how many policy versions behind the trainer each sample is, and how the trust region
behaves per lag bucket (issue 14.4).

Where the versions come from (verl 0.9.1): the rollout server labels each reply with the `global_steps` of its last
weight update; `FullyAsyncLLMServerClient.generate` keeps, across a response's resumed replies, the first and last
labels as `extra_fields["min_global_steps"]` / `["max_global_steps"]`. The first reply can be an abort that generated
no token (the request was waiting when the weights moved on) and carries the previous version: verl's
`min_global_steps` then makes a response sampled entirely by the new weights one version stale. So the plugin's agent
loop patch (`patches.agent_loop`) takes the label of every reply that generated at least one token, over the whole
agent-loop run (every turn), and stores the oldest as `extra_fields[SAMPLED_VERSION]`; verl's own fields are left as
they are. The v1 agent loop stores `extra_fields` (one dict per sample) in TransferQueue, and the actor's
`update_actor` reads every stored field, so each micro-batch that reaches `ppo_loss` carries `extra_fields`.
The trainer's version is the `global_steps` of the last `update_weights` call on the actor worker (the same label the
rollout got with those weights; verl passes it to the actor worker on every push, whatever the trainer mode):
`patches.engine_workers` records it and hands it to each mini-batch as the non-tensor field `TRAINER_VERSION`.

A sample's lag is trainer version - the oldest version that sampled any of its tokens (`SAMPLED_VERSION`; verl's
`min_global_steps` where the sample lacks it, e.g. a response of no token): 0 = sampled by the weights being trained
at the start of this step. Samples without a version (no `extra_fields`, or a server that never got one) count in no
lag metric.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

__all__ = [
    "TRAINER_VERSION",
    "SAMPLED_VERSION",
    "LAG_BUCKETS",
    "OVER_THRESHOLD",
    "record_trainer_version",
    "trainer_version",
    "sample_lags",
    "staleness_sums",
    "staleness_parts",
]

TRAINER_VERSION = "dppo_trainer_version"
"""Non-tensor field of a training mini-batch: the `global_steps` of the actor's last weight push."""

SAMPLED_VERSION = "dppo_oldest_sampling_version"
"""Key in a sample's `extra_fields`: the oldest `global_steps` among the rollout replies that generated its tokens."""

LAG_BUCKETS = (("0", 0, 0), ("1", 1, 1), ("2_3", 2, 3), ("4plus", 4, None))
"""(name, lowest lag, highest lag or None): the buckets of the per-lag metrics."""

_trainer_version: Optional[int] = None


def record_trainer_version(global_steps: Any) -> None:
    """Called with the `global_steps` of each `update_weights` on the actor worker (this process)."""
    global _trainer_version
    if global_steps is not None:
        _trainer_version = int(global_steps)


def trainer_version() -> Optional[int]:
    return _trainer_version


def sample_lags(data: Any) -> Optional[torch.Tensor]:
    """Per-sample lag [batch] (float, NaN where a sample has no version) of a micro-batch, or None when the batch
    carries no version information (sync runs without it, direct calls)."""
    keys = data.keys()
    if TRAINER_VERSION not in keys or "extra_fields" not in keys:
        return None
    from verl.utils import tensordict_utils as tu

    version = tu.get_non_tensor_data(data, key=TRAINER_VERSION, default=None)
    if version is None:
        return None
    extra_fields = data["extra_fields"]
    # tensordict may hand back one dict for a single sample, or for a stack of equal dicts
    extra_fields = [extra_fields] * len(data) if isinstance(extra_fields, dict) else list(extra_fields)
    if len(extra_fields) != len(data):
        return None
    lags = []
    for extra in extra_fields:
        oldest = None
        if isinstance(extra, dict):
            oldest = extra.get(SAMPLED_VERSION)
            oldest = extra.get("min_global_steps") if oldest is None else oldest
        lags.append(float("nan") if oldest is None else float(int(version) - int(oldest)))
    return torch.tensor(lags, dtype=torch.float32)


def staleness_sums(
    lags: torch.Tensor,
    valid: torch.Tensor,
    blocked: torch.Tensor,
    mismatch_tv: torch.Tensor,
    threshold: Optional[int] = None,
) -> torch.Tensor:
    """The sums behind every lag metric, on device (read back with the loss's other sums): tokens with a known lag,
    their summed lag, per bucket its tokens, its masked tokens and its summed mismatch TV, and the samples with a
    known lag (and a token in the update) and those of them at or over the threshold (lag >= `threshold`; none
    when `threshold` is None)."""
    sample_lags = lags.to(valid.device)
    lag = sample_lags.view(-1, 1).expand_as(valid)
    known = valid & ~torch.isnan(lag)
    lag = torch.nan_to_num(lag, nan=-1.0)
    sums = [known.sum().float(), (lag * known).sum()]
    for _, low, high in LAG_BUCKETS:
        in_bucket = known & (lag >= low) & ((lag <= high) if high is not None else True)
        sums += [in_bucket.sum().float(), (blocked & in_bucket).sum().float(), (mismatch_tv.float() * in_bucket).sum()]
    known_samples = known.any(dim=-1)  # [batch]: a version and a token in the update
    over = known_samples & (sample_lags >= threshold) if threshold is not None else torch.zeros_like(known_samples)
    sums += [known_samples.sum().float(), over.sum().float()]
    return torch.stack(sums)


OVER_THRESHOLD = "actor/dppo/lag_over_threshold_frac"
"""Share of the samples (with a version) whose lag reaches policy_loss.max_off_policy_threshold T: older than what
verl's replay buffer keeps (it drops a trajectory spanning more than T versions, the trainer's included)."""


def staleness_parts(values: list[float], threshold: Optional[int] = None) -> dict[str, tuple[float, float]]:
    """(numerator, denominator) of each lag metric from the sums of `staleness_sums`."""
    n_known, lag_sum = values[0], values[1]
    parts = {"actor/dppo/lag_mean": (lag_sum, n_known)}
    for i, (name, _, _) in enumerate(LAG_BUCKETS):
        n, n_blocked, tv = values[2 + 3 * i : 5 + 3 * i]
        parts[f"actor/dppo/lag_{name}/token_frac"] = (n, n_known)
        parts[f"actor/dppo/lag_{name}/masked_frac"] = (n_blocked, n)
        parts[f"actor/dppo/lag_{name}/mismatch_tv_mean"] = (tv, n)
    if threshold is not None:
        n_samples, n_over = values[2 + 3 * len(LAG_BUCKETS) : 4 + 3 * len(LAG_BUCKETS)]
        parts[OVER_THRESHOLD] = (n_over, n_samples)
    return parts
