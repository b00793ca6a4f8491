"""Top-K DPPO from the rollout engine to the training batch: vLLM / SGLang extraction on objects shaped like theirs,
K handed from policy_loss.topk to the rollout config (a Hydra-composed verl config), the agent-loop promotion through
verl's real `AgentLoopOutput.as_dict` (single and multi-turn, truncation), v1 padding samples, and the whole data
path from a vLLM-shaped server reply to the loss's D."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_dir

import verl
from verl.experimental.agent_loop.agent_loop import AgentLoopMetrics, AgentLoopOutput
from verl.trainer.ppo.padding_utils import construct_minimal_padding_template
from verl.workers.rollout.replica import TokenOutput

from verl_dppo.patches._server_common import EXTRA_IDS, EXTRA_LOGPROBS, RolloutTopKError
from verl_dppo.patches.agent_loop import record_turn, trajectory
from verl_dppo.patches.llm_server import sync_rollout_config
from verl_dppo.patches.sglang_async_server import extract_sglang_topk
from verl_dppo.patches.vllm_async_server import extract_vllm_topk
from vllm_fixtures import _Logprob, flat_from_dicts, per_token_loop_vllm_topk, vllm_shaped_logprobs

CONFIG_DIR = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")


@pytest.mark.parametrize("k", [1, 2, 5, 20])
def test_vllm_vectorised_extraction_equals_per_token_loop(k):
    positions, sampled = vllm_shaped_logprobs(300, k, vocab=1000, seed=k)
    ids, lps = extract_vllm_topk(positions, sampled, k)
    ref_ids, ref_lps = per_token_loop_vllm_topk(positions, sampled, k)
    assert ids.shape == (300, k) and lps.dtype == np.float32
    assert np.array_equal(ids, ref_ids) and np.array_equal(lps, ref_lps)
    # sampled outside the top-K never leaks into it; rows are in rank order (descending log-prob)
    for row, (entries, token) in enumerate(zip(positions, sampled)):
        assert (token in ids[row]) == (len(entries) == k)
    assert (np.diff(lps, axis=1) <= 0).all()
    # the same positions as vLLM's FlatLogprobs (sampled entry first, not de-duplicated)
    flat_ids, flat_lps = extract_vllm_topk(flat_from_dicts(positions, sampled, k), sampled, k)
    assert np.array_equal(flat_ids, ref_ids) and np.array_equal(flat_lps, ref_lps)


def test_vllm_extraction_refuses_a_reply_without_k_logprobs():
    positions, sampled = vllm_shaped_logprobs(5, 3, vocab=100, seed=0)
    positions[2] = {sampled[2]: _Logprob(-0.1, 1, "")}  # logprobs=0: the plugin did not reach the server
    with pytest.raises(RolloutTopKError, match="expected K=3"):
        extract_vllm_topk(positions, sampled, 3)


def test_sglang_extraction():
    top = [[(-0.1, 5, None), (-2.0, 9, "a"), (-3.0, 1, None)], [(-0.5, 2, None), (-0.9, 7, None), (-4.0, 3, "b")]]
    ids, lps = extract_sglang_topk(top, 3)
    assert ids.tolist() == [[5, 9, 1], [2, 7, 3]]
    assert np.allclose(lps, [[-0.1, -2.0, -3.0], [-0.5, -0.9, -4.0]])
    with pytest.raises(RolloutTopKError, match="expected K=4"):
        extract_sglang_topk(top, 4)


def compose_config(overrides):
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base=None):
        return compose(
            "ppo_trainer",
            overrides=[
                "actor_rollout_ref.actor.policy_loss._target_=verl_dppo.DPPOLossConfig",
                "+actor_rollout_ref.actor.policy_loss.topk=32",
                "actor_rollout_ref.rollout.name=vllm",
                "actor_rollout_ref.rollout.calculate_log_probs=True",
                *overrides,
            ],
        )


def test_k_reaches_the_rollout_config_from_policy_loss_topk():
    config = compose_config(["actor_rollout_ref.actor.policy_loss.loss_mode=dppo_topk_kl"])
    assert sync_rollout_config(config) == 32
    assert config.actor_rollout_ref.rollout.custom["dppo_topk"] == 32
    assert config.actor_rollout_ref.rollout.engine_kwargs.vllm.max_logprobs == 32  # vLLM's default 20 is raised
    assert sync_rollout_config(config) == 32  # idempotent


def test_vllm_max_logprobs_minus_one_is_no_cap():
    """vLLM reads max_logprobs=-1 as no cap (config/model.py; sampling_params.py takes the vocabulary size): kept."""
    config = compose_config(
        [
            "actor_rollout_ref.actor.policy_loss.loss_mode=dppo_topk_tv",
            "+actor_rollout_ref.rollout.engine_kwargs.vllm.max_logprobs=-1",
        ]
    )
    assert sync_rollout_config(config) == 32
    assert config.actor_rollout_ref.rollout.engine_kwargs.vllm.max_logprobs == -1


def test_truncated_sampling_is_refused_by_the_launcher_check_too():
    from verl_dppo.plugin.topk_mode import unsupported_settings

    config = compose_config(
        ["actor_rollout_ref.actor.policy_loss.loss_mode=troll", "actor_rollout_ref.rollout.top_p=0.95"]
    )
    assert any("top_p=0.95" in problem for problem in unsupported_settings(config))
    # raw log-probs are of the full distribution: not this problem
    config = compose_config(
        [
            "actor_rollout_ref.actor.policy_loss.loss_mode=troll",
            "actor_rollout_ref.rollout.top_p=0.95",
            "actor_rollout_ref.rollout.logprobs_mode=raw_logprobs",
        ]
    )
    assert not any("top_p" in problem for problem in unsupported_settings(config))


def test_other_modes_leave_the_config_alone():
    config = compose_config(["actor_rollout_ref.actor.policy_loss.loss_mode=dppo_binary_tv"])
    assert sync_rollout_config(config) is None
    assert not config.actor_rollout_ref.rollout.get("custom")


@pytest.mark.parametrize(
    "override, message",
    [
        ("actor_rollout_ref.rollout.calculate_log_probs=False", "calculate_log_probs=True"),
        (
            (
                "actor_rollout_ref.model.use_fused_kernels=True",  # fused: the torch backend only
                "actor_rollout_ref.model.fused_kernel_options.impl_backend=triton",
            ),
            "impl_backend=torch",
        ),
        ("+actor_rollout_ref.rollout.engine_kwargs.vllm.max_logprobs=20", "max_logprobs=20 < policy_loss.topk=32"),
        ("actor_rollout_ref.rollout.name=trtllm", "rollout.name=vllm, sglang or hf"),
        ("trainer.use_v1=False", "trainer.use_v1=True"),
        ("+actor_rollout_ref.rollout.custom.dppo_topk=8", "set only policy_loss.topk"),
        # processed log-probs of a truncated distribution are not mu's (issue 25.5)
        ("actor_rollout_ref.rollout.top_p=0.9", r"top_p=0.9, top_k=-1 and rollout.logprobs_mode=processed_logprobs"),
        ("actor_rollout_ref.rollout.top_k=50", r"top_k=50 and rollout.logprobs_mode=processed_logprobs"),
        # vLLM's raw log-probs are before temperature: not mu's at T != 1
        (
            ("actor_rollout_ref.rollout.logprobs_mode=raw_logprobs", "actor_rollout_ref.rollout.temperature=0.7"),
            "raw_logprobs reports log-probs before temperature",
        ),
    ],
)
def test_rollout_settings_that_cannot_work_are_refused(override, message):
    overrides = list(override) if isinstance(override, tuple) else [override]
    config = compose_config(["actor_rollout_ref.actor.policy_loss.loss_mode=dppo_topk_tv", *overrides])
    with pytest.raises(ValueError, match=message):
        sync_rollout_config(config)


def reply(token_ids, ids, lps):
    return TokenOutput(
        token_ids=token_ids,
        log_probs=[-0.5] * len(token_ids),
        extra_fields={"global_steps": 1, EXTRA_IDS: ids, EXTRA_LOGPROBS: lps},
    )


def loop_output(prompt, response, mask):
    return AgentLoopOutput(
        prompt_ids=prompt,
        response_ids=response,
        response_mask=mask,
        response_logprobs=[-0.5] * len(response),
        metrics=AgentLoopMetrics(),
        num_turns=2,
    )


def test_single_turn_promotion_through_as_dict_with_truncation():
    ids = np.arange(10 * 3).reshape(10, 3)
    lps = -np.arange(10 * 3, dtype=np.float32).reshape(10, 3)
    generated = list(range(50, 60))
    with trajectory():
        out = reply(generated, ids, lps)
        record_turn(out)
        assert EXTRA_IDS not in out.extra_fields  # not left in the non-tensor extra_fields
        # the single-turn loop truncates the response to response_length=7
        fields = loop_output([1, 2], generated[:7], [1] * 7).as_dict()
    assert fields["rollout_topk_ids"].shape == (7, 3) and fields["rollout_topk_ids"].dtype == torch.int64
    assert torch.equal(fields["rollout_topk_ids"], torch.from_numpy(ids[:7]))
    assert torch.equal(fields["rollout_topk_logprobs"], torch.from_numpy(lps[:7]))
    assert fields["rollout_topk_ids"].shape[0] == fields["responses"].shape[0]


def test_multi_turn_rows_skip_tool_tokens():
    with trajectory():
        record_turn(reply([11, 12], np.array([[1, 2], [3, 4]]), np.full((2, 2), -1.0, np.float32)))
        record_turn(reply([13], np.array([[5, 6]]), np.full((1, 2), -2.0, np.float32)))
        # response = turn 1 (2 tokens) + tool reply (3 tokens, mask 0) + turn 2 (1 token)
        fields = loop_output([1], [11, 12, 90, 91, 92, 13], [1, 1, 0, 0, 0, 1]).as_dict()
    assert fields["rollout_topk_ids"].tolist() == [[1, 2], [3, 4], [0, 0], [0, 0], [0, 0], [5, 6]]
    assert fields["rollout_topk_logprobs"][:, 0].tolist() == [-1.0, -1.0, 0.0, 0.0, 0.0, -2.0]


def test_misaligned_tokens_raise_instead_of_shifting():
    with trajectory():
        record_turn(reply([11, 12], np.array([[1, 2], [3, 4]]), np.zeros((2, 2), np.float32)))
        with pytest.raises(RolloutTopKError, match="cannot be aligned"):
            loop_output([1], [11, 99], [1, 1]).as_dict()


def test_outside_an_agent_loop_nothing_changes():
    out = reply([11], np.array([[1, 2]]), np.zeros((1, 2), np.float32))
    record_turn(out)
    assert EXTRA_IDS in out.extra_fields
    assert "rollout_topk_ids" not in loop_output([1], [11], [1]).as_dict()


def test_v1_padding_sample_gets_rows_of_its_own_length():
    source = {
        "prompts": torch.tensor([1, 2, 3]),
        "responses": torch.tensor([4, 5, 6, 7]),
        "input_ids": torch.arange(7),
        "attention_mask": torch.ones(7, dtype=torch.int64),
        "position_ids": torch.arange(7),
        "response_mask": torch.ones(4, dtype=torch.int64),
        "rollout_log_probs": torch.zeros(4),
        "rollout_topk_ids": torch.ones(4, 5, dtype=torch.int64),
        "rollout_topk_logprobs": torch.zeros(4, 5),
    }
    sample, tag = construct_minimal_padding_template(source, {"status": "success"}, eos_token_id=0)
    assert tag["is_padding"]
    assert sample["rollout_topk_ids"].shape == (sample["responses"].shape[0], 5)
    assert sample["rollout_topk_logprobs"].shape == (sample["responses"].shape[0], 5)


def test_data_path_from_vllm_reply_to_the_loss_divergence():
    """vLLM-shaped reply -> extraction -> agent loop -> TransferQueue tensordict -> engine hook -> D in the loss."""
    from verl.utils.tensordict_utils import list_of_dict_to_tensordict

    from transformers import LlamaConfig, LlamaForCausalLM

    from helpers import actor_config
    from test_topk_actor import K, VOCAB, run_engine

    torch.manual_seed(0)
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=2,
        )
    ).eval()
    fields = []
    for seed, (prompt, n_tokens) in enumerate([([3, 4, 5], 4), ([6, 7], 6)]):
        positions, sampled = vllm_shaped_logprobs(n_tokens, K, vocab=VOCAB, seed=seed)
        # make each row a proper distribution's top-K: scale log-probs so the mass stays below 1
        for entries in positions:
            for lp in entries.values():
                lp.logprob = lp.logprob - 2.0
        ids, lps = extract_vllm_topk(positions, sampled, K)
        with trajectory():
            record_turn(
                TokenOutput(
                    token_ids=sampled, log_probs=[-2.5] * n_tokens, extra_fields={EXTRA_IDS: ids, EXTRA_LOGPROBS: lps}
                )
            )
            field = loop_output(prompt, sampled, [1] * n_tokens).as_dict()
        field["input_ids"] = torch.cat([field["prompts"], field["responses"]])
        field["position_ids"] = torch.arange(field["input_ids"].numel())
        field["old_log_probs"] = field["rollout_log_probs"]
        field["advantages"] = torch.ones(n_tokens)
        field.pop("extra_fields", None)
        field.pop("metrics", None)
        fields.append(field)
    from verl.utils import tensordict_utils as tu

    data = list_of_dict_to_tensordict(fields)
    assert data["rollout_topk_ids"].is_nested and data["rollout_topk_ids"].values().shape == (10, K)
    data["temperature"] = torch.ones(2)
    tu.assign_non_tensor(
        data,
        use_remove_padding=True,
        distillation_use_topk=True,
        dp_size=1,
        batch_num_tokens=None,
        global_batch_size=None,
    )
    _, model_output = run_engine(model, data, actor_config("dppo_topk_tv", topk=K))
    from verl.workers.utils.padding import no_padding_2_padding

    tv = no_padding_2_padding(model_output["dppo_topk_tv"], data)
    assert tv.shape == (2, 6) and (tv[0, :4] > 0).all() and (tv[1] > 0).all() and (tv[0, 4:] == 0).all()
