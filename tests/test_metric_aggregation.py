"""Issue 8.2: every diagnostic equals its value over the whole mini-batch (and all data-parallel ranks), however
the mini-batch is cut into micro-batches, aggregated exactly as verl 0.9.1's engine worker aggregates.

verl's path, reproduced with its own functions: `ppo_loss` per micro-batch -> `append_to_dict` into one `Metric`
per name (`postprocess_batch_func`) -> a list of them, one per rank (`allgather_dict_into_dict`) -> the plugin's
`TrainingWorker.train_batch` patch (`exact_ratio_metrics`) -> `Metric.aggregate_dp` (`train_mini_batch`).
The truth: the same loss called once on the whole mini-batch (every rank's sequences in one micro-batch).
"""

import math

import pytest
import torch

from helpers import actor_config, v1_micro_batch
from verl.utils.metric import Metric
from verl.utils.py_functional import append_to_dict
from verl.workers.utils.losses import ppo_loss

from verl_dppo.plugin.metrics import RatioMetric, exact_ratio_metrics

T = 8


def sequences(seed: int, count: int):
    """Responses of GRPO-like data: one advantage per sequence, lengths 1..T, peaked and flat tokens."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i in range(count):
        n = int(torch.randint(1, T + 1, (1,), generator=gen))
        mu = torch.log(torch.rand(n, generator=gen).clamp(min=1e-3))
        mu[0] = -1e-7  # a dominant token
        pi = (mu + 0.8 * torch.randn(n, generator=gen)).clamp(max=-1e-6)
        adv = torch.full((n,), float(torch.randn((), generator=gen)))
        entropy = torch.rand(n, generator=gen) * 3
        out.append((pi, mu, adv, entropy))
    return out


def call(config, seqs):
    lens = [s[0].numel() for s in seqs]

    def pad(j):
        t = torch.zeros(len(seqs), T)
        for i, s in enumerate(seqs):
            t[i, : lens[i]] = s[j]
        return t

    pi, mu, adv, entropy = pad(0), pad(1), pad(2), pad(3)
    model_output, data, _ = v1_micro_batch(pi, mu, adv, lens, rollout_log_prob=mu, entropy=entropy)
    _, metrics = ppo_loss(config, model_output, data)
    return metrics


def verl_aggregate(config, ranks):
    """ranks: per rank, its list of micro-batches (lists of sequences); the same count on each, as verl ensures."""
    gathered = {}
    for micro_batches in ranks:
        per_rank = {}
        for micro_batch in micro_batches:
            append_to_dict(per_rank, call(config, micro_batch))
        for name, metric in per_rank.items():
            gathered.setdefault(name, []).append(metric)
    exact_ratio_metrics(gathered)
    return {name: Metric.aggregate_dp(metrics) for name, metrics in gathered.items()}


CUTS = [
    [[[0, 1], [2], [3, 4, 5]], [[6], [7, 8, 9, 10], [11]]],  # two ranks, micro-batches of 1-4 sequences
    [[[0], [1], [2], [3], [4, 5]], [[6, 7], [8], [9], [10], [11]]],
    [[list(range(12))]],  # one rank, one micro-batch: the truth itself
]


@pytest.mark.parametrize("mode", ["dppo_binary_tv", "dppo_binary_kl", "grpo_clip", "pg_is"])
@pytest.mark.parametrize("cut", range(len(CUTS)))
def test_every_diagnostic_is_exact_over_the_mini_batch(mode, cut):
    seqs = sequences(seed=3, count=12)
    config = actor_config(mode, delta_low=0.15, delta_high=0.15, ratio_cap=10.0)
    truth = {name: metric.aggregate() for name, metric in call(config, seqs).items()}
    ranks = [[[seqs[i] for i in mb] for mb in rank] for rank in CUTS[cut]]
    assert len({len(rank) for rank in ranks}) == 1  # verl gives every rank the same number of micro-batches
    got = verl_aggregate(config, ranks)
    for name, value in truth.items():
        if name in ("actor/pg_loss", "actor/entropy_loss"):
            continue  # verl's own, normalised by verl's global batch info
        assert got[name] == pytest.approx(value, rel=1e-5, abs=1e-7), name
    assert isinstance(call(config, seqs[:2])["actor/dppo/masked_frac_pos"], RatioMetric)


def test_the_issue_example_is_no_longer_biased():
    # Micro-batches of two sequences with constant advantages: the masked fraction among A > 0 tokens.
    config = actor_config("dppo_binary_tv", delta_low=0.15, delta_high=0.15, ratio_cap=10.0)
    mu_up, pi_up = torch.log(torch.tensor([0.1, 0.1, 0.1, 0.5])), torch.log(torch.tensor([0.5, 0.5, 0.5, 0.52]))
    seq_up = (pi_up, mu_up, torch.ones(4), torch.ones(4))  # pi rose from mu by 0.4 on 3 of 4 tokens: blocked
    half = torch.log(torch.tensor([0.5, 0.5]))
    seq_down = (half, half, -torch.ones(2), torch.ones(2))
    # micro-batch 1: only A > 0 tokens (3/4 blocked); micro-batch 2: only A < 0 tokens (none of the kind).
    got = verl_aggregate(config, [[[seq_up], [seq_down]]])
    assert got["actor/dppo/masked_frac_pos"] == pytest.approx(0.75)
    mu_blocked = math.fsum([0.1, 0.1, 0.1]) / 3
    assert got["actor/dppo/masked_rollout_prob_mean"] == pytest.approx(mu_blocked, rel=1e-5)
