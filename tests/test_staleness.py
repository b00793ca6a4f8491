"""Issue 14.4: staleness diagnostics. Each sample's lag is the trainer's version (the `global_steps` of the actor's
last weight push) minus the oldest version that sampled its response (the oldest rollout reply that generated a
token, as the plugin's agent-loop patch records it: verl's `min_global_steps` counts an empty first abort);
the token-weighted mean lag and, per lag bucket (0, 1, 2-3, 4+), the masked fraction and the mean mismatch TV are
exact over the mini-batch and the data-parallel ranks, through verl's real `ppo_loss` and its metric aggregation.
"""

import asyncio
import math

import pytest
import torch
from tensordict import NonTensorStack

from helpers import actor_config, v1_micro_batch
from verl.utils import tensordict_utils as tu
from verl.utils.metric import Metric
from verl.utils.py_functional import append_to_dict
from verl.workers.utils.losses import ppo_loss

from verl_dppo.plugin import log_once, staleness
from verl_dppo.plugin.metrics import RatioMetric, exact_ratio_metrics

T = 4
VERSION = 10
LAG_METRICS = [
    "actor/dppo/lag_mean",
    *(
        f"actor/dppo/lag_{b}/{m}"
        for b in ("0", "1", "2_3", "4plus")
        for m in ("token_frac", "masked_frac", "mismatch_tv_mean")
    ),
]


def sequence(lag, pi, mu, adv):
    """(lag, pi(a_t), mu(a_t), A): probabilities per token; lag None = a sample without a version."""
    return lag, torch.tensor(pi), torch.tensor(mu), float(adv)


# dppo_binary_tv with delta 0.15: a token whose pi moved 0.4 from mu in the advantage's direction is masked (Eq. 12).
SEQS = [
    sequence(0, [0.9, 0.55], [0.5, 0.5], +1),  # 1 of 2 masked, TV 0.4 + 0.05
    sequence(1, [0.9, 0.9, 0.9], [0.5, 0.5, 0.5], +1),  # 3 of 3 masked
    sequence(3, [0.1, 0.5], [0.5, 0.5], -1),  # 1 of 2 masked (pi fell, A < 0)
    sequence(8, [0.6], [0.5], +1),  # none masked
    sequence(0, [0.5, 0.5, 0.5, 0.5], [0.5, 0.5, 0.5, 0.5], -1),
    sequence(8, [0.9, 0.2, 0.5], [0.5, 0.6, 0.5], +1),  # 1 of 3 masked (the A > 0 rise)
    sequence(3, [0.3], [0.5], -1),  # masked
    sequence(1, [0.5, 0.52], [0.5, 0.5], +1),
]


def micro_batch(seqs, with_versions=True):
    lens = [s[1].numel() for s in seqs]
    pi, mu, adv = torch.zeros(len(seqs), T), torch.zeros(len(seqs), T), torch.zeros(len(seqs), T)
    for i, (_, p, m, a) in enumerate(seqs):
        pi[i, : lens[i]], mu[i, : lens[i]], adv[i, : lens[i]] = p.log(), m.log(), a
    model_output, data, _ = v1_micro_batch(pi, mu, adv, lens, rollout_log_prob=mu)
    if with_versions:
        # As the v1 agent loop stores them in TransferQueue: one extra_fields dict per sample.
        data.set(
            "extra_fields",
            NonTensorStack(
                *[
                    {
                        "min_global_steps": None if lag is None else VERSION - lag,
                        "max_global_steps": None if lag is None else VERSION - max(lag - 1, 0),
                    }
                    for lag, *_ in seqs
                ]
            ),
        )
        tu.assign_non_tensor(data, **{staleness.TRAINER_VERSION: VERSION})
    return model_output, data


def call(seqs, with_versions=True, threshold=None):
    config = actor_config("dppo_binary_tv", delta_low=0.15, delta_high=0.15, max_off_policy_threshold=threshold)
    _, metrics = ppo_loss(config, *micro_batch(seqs, with_versions))
    return metrics


def verl_aggregate(ranks, threshold=None):
    """As verl's worker: per rank one Metric per name over its micro-batches, gathered over ranks, the plugin's
    train_batch patch (exact_ratio_metrics), then Metric.aggregate_dp."""
    gathered = {}
    for micro_batches in ranks:
        per_rank = {}
        for seqs in micro_batches:
            append_to_dict(per_rank, call(seqs, threshold=threshold))
        for name, metric in per_rank.items():
            gathered.setdefault(name, []).append(metric)
    exact_ratio_metrics(gathered)
    return {name: Metric.aggregate_dp(metrics) for name, metrics in gathered.items()}


def by_hand(seqs):
    """Token by token: lag, masked (Eq. 12, delta 0.15), |pi - mu|."""
    tokens = []
    for lag, pi, mu, adv in seqs:
        for p, m in zip(pi.tolist(), mu.tolist()):
            masked = (adv > 0 and p - m > 0.15) or (adv < 0 and m - p > 0.15)
            tokens.append((lag, masked, abs(p - m)))
    known = [t for t in tokens if t[0] is not None]
    out = {"actor/dppo/lag_mean": math.fsum(t[0] for t in known) / len(known)}
    for name, low, high in (("0", 0, 0), ("1", 1, 1), ("2_3", 2, 3), ("4plus", 4, 10**9)):
        bucket = [t for t in known if low <= t[0] <= high]
        out[f"actor/dppo/lag_{name}/token_frac"] = len(bucket) / len(known)
        out[f"actor/dppo/lag_{name}/masked_frac"] = sum(t[1] for t in bucket) / len(bucket)
        out[f"actor/dppo/lag_{name}/mismatch_tv_mean"] = math.fsum(t[2] for t in bucket) / len(bucket)
    return out


CUTS = [
    [[[0, 1], [2], [3, 4]], [[5], [6, 7], [8]]],  # two ranks, three micro-batches each; 8 = the unversioned sample
    [[[0], [1], [2], [3], [4, 5, 6, 7, 8]]],  # one rank, buckets split across micro-batches
]


@pytest.mark.parametrize("cut", range(len(CUTS)))
def test_lag_metrics_equal_hand_computed_values_over_micro_batches_and_ranks(cut):
    seqs = SEQS + [sequence(None, [0.9], [0.5], +1)]  # no version: in no lag metric
    expected = by_hand(seqs)
    assert expected["actor/dppo/lag_mean"] == pytest.approx((0 * 6 + 1 * 5 + 3 * 3 + 8 * 4) / 18)
    got = verl_aggregate([[[seqs[i] for i in mb] for mb in rank] for rank in CUTS[cut]])
    for name in LAG_METRICS:
        assert got[name] == pytest.approx(expected[name], rel=1e-5, abs=1e-7), name
    # the same values the loss reports on the whole mini-batch in one call
    truth = call(seqs)
    for name in LAG_METRICS:
        assert isinstance(truth[name], RatioMetric)
        assert got[name] == pytest.approx(truth[name].aggregate(), rel=1e-5, abs=1e-7), name


def test_a_batch_without_version_info_reports_no_lag_metric():
    metrics = call(SEQS, with_versions=False)
    assert not [name for name in metrics if "/lag_" in name]
    assert "actor/dppo/masked_frac_pos" in metrics  # the other diagnostics are unchanged


def test_the_worker_records_the_pushed_version_and_hands_it_to_the_mini_batch(monkeypatch):
    monkeypatch.setattr(staleness, "_trainer_version", None)  # restored after the test: no leak into others
    from verl_dppo.patches.engine_workers import _assign_trainer_version, _record_version

    calls = []

    async def update_weights(self, global_steps=None, mode="auto"):
        calls.append((global_steps, mode))

    asyncio.run(_record_version(update_weights)(None, global_steps=7, mode="naive"))
    assert calls == [(7, "naive")] and staleness.trainer_version() == 7
    _, data = micro_batch(SEQS[:2], with_versions=False)
    _assign_trainer_version(data)
    assert staleness.TRAINER_VERSION not in data.keys()  # no extra_fields: nothing to compare it with
    data.set("extra_fields", NonTensorStack({"min_global_steps": 5}, {"min_global_steps": 7}))
    _assign_trainer_version(data)
    assert staleness.sample_lags(data).tolist() == [2.0, 0.0]


def test_a_single_sample_micro_batch_and_equal_extra_fields_give_their_lag():
    _, data = micro_batch(SEQS[3:4])
    assert staleness.sample_lags(data).tolist() == [8.0]
    _, data = micro_batch([SEQS[1], SEQS[7]])  # both lag 1: equal dicts
    assert staleness.sample_lags(data).tolist() == [1.0, 1.0]


@pytest.mark.parametrize("threshold, over", [(8, 2), (4, 2), (3, 4), (1, 6), (9, 0)])
@pytest.mark.parametrize("cut", range(len(CUTS)))
def test_samples_older_than_verl_keeps_are_counted_exactly(cut, threshold, over):
    """verl's replay buffer keeps a trajectory spanning at most T = max_off_policy_threshold versions up to the
    trainer's (lag + 1 <= T); an older sample that reaches the loss is counted, as a share of the versioned samples,
    exact over micro-batches and ranks. The samples' lags: 0, 1, 3, 8, 0, 8, 3, 1 (and one without a version)."""
    seqs = SEQS + [sequence(None, [0.9], [0.5], +1)]
    got = verl_aggregate([[[seqs[i] for i in mb] for mb in rank] for rank in CUTS[cut]], threshold=threshold)
    assert got[staleness.OVER_THRESHOLD] == pytest.approx(over / 8)


def test_an_over_threshold_sample_is_warned_once_naming_the_setting(monkeypatch, caplog):
    monkeypatch.setattr(log_once, "_SEEN", set())
    call(SEQS[:3], threshold=8)  # lags 0, 1, 3: nothing to say
    assert not [r for r in caplog.records if "max_off_policy_threshold" in r.getMessage()]
    call(SEQS, threshold=8)
    call(SEQS, threshold=8)
    warned = [r.getMessage() for r in caplog.records if "max_off_policy_threshold=8" in r.getMessage()]
    assert len(warned) == 1 and staleness.OVER_THRESHOLD in warned[0]


def test_no_threshold_no_over_threshold_metric():
    assert staleness.OVER_THRESHOLD not in call(SEQS)
    assert staleness.OVER_THRESHOLD not in call(SEQS, with_versions=False, threshold=8)


@pytest.mark.parametrize("bad", [0, -1, 2.5, "x", True])
def test_a_bad_threshold_is_refused_naming_the_key(bad):
    with pytest.raises(ValueError, match="max_off_policy_threshold"):
        actor_config("dppo_binary_tv", max_off_policy_threshold=bad)


# ------------------------------------------------- the version that sampled a response, through verl's resume loop


class VerlShapedServer:
    """Replies as verl 0.9.1's vLLM server (`vLLMHttpServer.generate`) makes them, one per call, from `replies`
    [(tokens generated, stop reason, weights version)]: an abort that generated nothing is `TokenOutput(token_ids=[],
    log_probs=None, routed_experts=None, stop_reason="aborted", extra_fields={"global_steps": v})` (a request parked
    or aborted before its first token while the weights were being updated); a reply with tokens carries their
    log-probs and `num_cached_tokens` beside `global_steps`. The last reply completes the answer."""

    def __init__(self, tokenizer, replies):
        self.generate = self  # verl awaits `server.generate.remote(...)`
        self.answer = tokenizer.encode("The answer is 5.<|im_end|>", add_special_tokens=False)
        self.replies = replies
        self.calls = 0
        self.done = 0

    async def remote(self, *, prompt_ids, sampling_params, **kwargs):
        from verl.workers.rollout.replica import TokenOutput

        count, stop_reason, version = self.replies[self.calls]
        self.calls += 1
        if count == 0:
            return TokenOutput(
                token_ids=[],
                log_probs=None,
                routed_experts=None,
                stop_reason=stop_reason,
                extra_fields={"global_steps": version},
            )
        count = len(self.answer) - self.done if count is None else count
        token_ids = self.answer[self.done : self.done + count]
        self.done += count
        return TokenOutput(
            token_ids=token_ids,
            log_probs=[-0.5] * count,
            routed_experts=None,
            stop_reason=stop_reason,
            num_preempted=0,
            extra_fields={"global_steps": version, "num_cached_tokens": 0},
        )


# (replies, verl's min_global_steps, the oldest version that sampled a token) with the trainer at VERSION.
RESUMED = [
    # the ISSUE: an empty abort under the previous weights, then the whole response under the trainer's
    ([(0, "aborted", VERSION - 1), (None, "completed", VERSION)], VERSION - 1, VERSION),
    # an empty abort three versions back, tokens one version back, the rest under the trainer's
    (
        [(0, "aborted", VERSION - 3), (5, "aborted", VERSION - 1), (None, "completed", VERSION)],
        VERSION - 3,
        VERSION - 1,
    ),
    # tokens two versions back, an empty abort between, the rest under the trainer's: the first reply counts
    (
        [(4, "aborted", VERSION - 2), (0, "aborted", VERSION - 1), (None, "completed", VERSION)],
        VERSION - 2,
        VERSION - 2,
    ),
    # not resumed
    ([(None, "completed", VERSION)], VERSION, VERSION),
]


def test_the_lag_is_measured_from_the_oldest_reply_that_generated_a_token(monkeypatch):
    """verl's real `SingleTurnAgentLoop` on verl's real resume loop (`FullyAsyncLLMServerClient.generate`, through
    the plugin's patched `LLMServerClient.generate`), its `as_dict` fields stored as the v1 agent loop stores them
    in TransferQueue (`list_of_dict_to_tensordict`), the trainer's version recorded from the weight push and handed
    to the mini-batch as the worker patch does, then verl's `ppo_loss`: a response sampled entirely by the
    trainer's weights has lag 0 even when its first reply was an empty abort labelled with the previous version
    (verl's `min_global_steps`, left as verl sets it, says 1)."""
    from test_async import ResumingClient
    from test_topk_token_builders import PROMPT, compose_config, family_named
    from verl.experimental.agent_loop.agent_loop import DictConfigWrap
    from verl.experimental.agent_loop.single_turn_agent_loop import SingleTurnAgentLoop
    from verl.utils.dataset.rl_dataset import RLHFDataset
    from verl.workers.rollout import llm_server

    from verl_dppo.patches.agent_loop import trajectory
    from verl_dppo.patches.engine_workers import _assign_trainer_version

    sleep = asyncio.sleep  # verl's loop sleeps 1 s before each resume
    monkeypatch.setattr(llm_server.asyncio, "sleep", lambda delay, *args: sleep(0, *args))
    family = family_named("default")
    tokenizer = family.make_tokenizer()
    config = compose_config(response_length=64)

    async def rollout(replies):
        server = VerlShapedServer(tokenizer, replies)
        loop = SingleTurnAgentLoop(
            DictConfigWrap(config),
            ResumingClient(config, server),
            tokenizer,
            None,
            RLHFDataset,
            DictConfigWrap(config.data),
            hf_model_type=family.model_type,
        )
        with trajectory():  # as the plugin's `AgentLoopWorker._run_agent_loop` patch opens it
            output = await loop.run(sampling_params={}, raw_prompt=list(PROMPT))
            fields = output.as_dict()
        assert server.calls == len(replies) and fields["responses"].tolist() == server.answer
        return fields

    stored = tu.list_of_dict_to_tensordict([asyncio.run(rollout(replies)) for replies, *_ in RESUMED])
    extra_fields = list(stored["extra_fields"])
    assert [extra["min_global_steps"] for extra in extra_fields] == [verl for _, verl, _ in RESUMED]
    expected = [float(VERSION - oldest) for *_, oldest in RESUMED]
    assert expected == [0.0, 1.0, 2.0, 0.0]

    monkeypatch.setattr(staleness, "_trainer_version", None)
    staleness.record_trainer_version(VERSION)
    seqs = [SEQS[0], SEQS[1], SEQS[2], SEQS[4]]  # 2, 3, 2 and 4 tokens
    model_output, data = micro_batch(seqs, with_versions=False)
    data.set("extra_fields", stored["extra_fields"])
    _assign_trainer_version(data)
    assert staleness.sample_lags(data).tolist() == expected
    config = actor_config("dppo_binary_tv", delta_low=0.15, delta_high=0.15, max_off_policy_threshold=1)
    _, metrics = ppo_loss(config, model_output, data)
    value = {name: metric.aggregate() for name, metric in metrics.items() if "/lag_" in name}
    assert value["actor/dppo/lag_mean"] == pytest.approx((0 * 2 + 1 * 3 + 2 * 2 + 0 * 4) / 11)
    assert value["actor/dppo/lag_0/token_frac"] == pytest.approx(6 / 11)
    assert value["actor/dppo/lag_1/token_frac"] == pytest.approx(3 / 11)
    assert value["actor/dppo/lag_2_3/token_frac"] == pytest.approx(2 / 11)
    assert value[staleness.OVER_THRESHOLD] == pytest.approx(2 / 4)  # lag >= 1: the second and third samples
