"""The `hf` rollout server (verl_dppo.rehearsal.hf_rollout): what verl's agent loop and the DPPO losses rely on.

Checked against a plain transformers forward of the whole sequence (no cache, no padding, one request at a time):
requests sent together are generated as one batch with a KV cache, and each token's log-prob is that of the
distribution it was sampled from (logits / temperature, top-k, then top-p: vLLM's processed_logprobs); the top-K
row of each token is the top-K of the temperature-scaled log-softmax before truncation, in the `extra_fields`
layout the vLLM/SGLang patches produce; abort returns the tokens so far; stop ids end a response; a setting the
server cannot honour, or a prompt longer than the context, is one clear error.
"""

from __future__ import annotations

import math

import asyncio
import types

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from verl.workers.rollout import llm_server

from verl_dppo.patches import agent_loop

from verl_dppo.plugin.rollout_fields import EXTRA_IDS, EXTRA_LOGPROBS
from verl_dppo.rehearsal.hf_rollout.engine import HFRolloutError, parse_sampling_params, sample_next
from verl_dppo.rehearsal.hf_rollout.server import HFRolloutServer

VOCAB = 256
K = 8


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    path = tmp_path_factory.mktemp("hf_rollout_model")
    config = Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=64,
        initializer_range=0.3,
        eos_token_id=1,
        pad_token_id=0,
        bos_token_id=None,
    )
    torch.manual_seed(0)
    Qwen3ForCausalLM(config).save_pretrained(path)
    return path


def make_server(model_dir, topk=K, **rollout):
    from omegaconf import OmegaConf

    from verl.workers.config import RolloutConfig

    settings = dict(
        name="hf",
        prompt_length=24,
        response_length=16,
        dtype="float32",
        max_num_seqs=64,
        seed=7,
        custom={"dppo_topk": topk} if topk else None,
    )
    settings.update(rollout)
    model_config = OmegaConf.create(
        {
            "path": str(model_dir),
            "local_path": str(model_dir),
            "trust_remote_code": False,
            "override_config": {"attn_implementation": "sdpa"},
            "generation_config": None,
        }
    )
    server = HFRolloutServer(RolloutConfig(**settings), model_config, device="cpu")
    asyncio.run(server.init_engine())
    return server


@pytest.fixture(scope="module")
def server(model_dir):
    return make_server(model_dir)


def full_forward_logits(server, prompt, response):
    """Logits that predict each response token, from one uncached, unpadded forward of prompt + response."""
    ids = torch.tensor([list(prompt) + list(response)])
    with torch.no_grad():
        logits = server.engine.model(input_ids=ids).logits[0].float()
    return logits[len(prompt) - 1 : len(prompt) - 1 + len(response)]


def truncated_logprobs(logits, temperature, top_k=-1, top_p=1.0):
    """The reference: vLLM's sampler order (temperature, top-k, top-p), written plainly, one row at a time."""
    out = []
    for row in logits:
        scaled = row / temperature
        values, order = scaled.sort(descending=True)
        keep = torch.ones_like(values, dtype=torch.bool)
        if top_k > 0:
            keep[top_k:] = False
        probs = torch.softmax(values.masked_fill(~keep, float("-inf")), -1)
        keep &= (probs.cumsum(-1) - probs) < top_p
        keep[0] = True
        masked = torch.full_like(row, float("-inf"))
        masked[order[keep]] = scaled[order[keep]]
        out.append(torch.log_softmax(masked, -1))
    return torch.stack(out)


PROMPTS = [[5, 9, 17, 3], [40, 41], [7, 7, 7, 7, 7, 7, 7, 12], [100], [200, 3, 4], [60, 61, 62, 63, 64]]


async def _generate_all(server, prompts, params):
    return await asyncio.gather(*[server.generate(p, dict(params), f"r{i}") for i, p in enumerate(prompts)])


def test_requests_sent_together_are_one_batch_and_logprobs_are_of_the_sampling_distribution(server):
    """Six requests sent together: one batch (one prefill, a shared KV cache); each token's log-prob equals the
    truncated distribution's log-prob recomputed without cache or padding (1e-4: float summation order), and not the
    untruncated one."""
    params = dict(temperature=0.8, top_k=20, top_p=0.9, max_tokens=12, logprobs=True, ignore_eos=True)
    server.engine.batch_sizes.clear()
    outputs = asyncio.run(_generate_all(server, PROMPTS, params))
    assert server.engine.batch_sizes == [len(PROMPTS)]
    differs = 0.0
    for prompt, out in zip(PROMPTS, outputs):
        assert len(out.token_ids) == 12 and len(out.log_probs) == 12 and out.stop_reason == "completed"
        logits = full_forward_logits(server, prompt, out.token_ids)
        reference = truncated_logprobs(logits, 0.8, 20, 0.9)
        tokens = torch.tensor(out.token_ids)
        expected = reference.gather(1, tokens[:, None])[:, 0]
        assert torch.isfinite(expected).all(), "a token was sampled outside the top-k / top-p support"
        assert torch.allclose(torch.tensor(out.log_probs), expected, atol=1e-4)
        untruncated = torch.log_softmax(logits / 0.8, -1).gather(1, tokens[:, None])[:, 0]
        differs = max(differs, float((untruncated - expected).abs().max()))
    assert differs > 1e-3  # the check above could tell the truncated distribution from the full one


def test_topk_rows_are_the_untruncated_tempered_topk_one_per_token(server, caplog, monkeypatch):
    """extra_fields carries [T, K] ids (int64) and log-probs (float32), rank order, one row per generated token, from
    log_softmax(logits / temperature) over the whole vocabulary, before top-k/top-p truncation."""
    from verl_dppo.plugin import log_once

    monkeypatch.setattr(log_once, "_SEEN", set())
    params = dict(temperature=0.7, top_k=3, top_p=0.5, max_tokens=10, logprobs=True, ignore_eos=True)
    out = asyncio.run(server.generate(PROMPTS[0], dict(params), "topk"))
    ids, lps = out.extra_fields[EXTRA_IDS], out.extra_fields[EXTRA_LOGPROBS]
    assert ids.shape == (len(out.token_ids), K) and lps.shape == ids.shape
    assert ids.dtype == np.int64 and lps.dtype == np.float32
    reference = torch.log_softmax(full_forward_logits(server, PROMPTS[0], out.token_ids) / 0.7, -1)
    top = reference.topk(K, dim=-1)
    np.testing.assert_array_equal(ids, top.indices.numpy())
    np.testing.assert_allclose(lps, top.values.numpy(), atol=1e-4)
    assert (np.diff(lps, axis=1) <= 0).all()
    assert (lps[:, 3:] > -np.inf).all()  # ranks beyond top_k=3 are still reported: the row is not truncated
    # ... while the sampled log-prob is of the truncated one: said once, as the vLLM path says it (issue 24)
    assert any("top_p=0.5 / top_k=3 with rollout.logprobs_mode=processed_logprobs" in m for m in caplog.messages)
    assert out.extra_fields["global_steps"] is None


def test_greedy_max_tokens_and_stop_ids(server):
    """temperature 0 takes the argmax; max_tokens bounds the response; a stop id ends it (the stop token included,
    as vLLM returns it)."""
    greedy = asyncio.run(
        server.generate(PROMPTS[2], dict(temperature=0, max_tokens=8, ignore_eos=True, logprobs=True), "g")
    )
    logits = full_forward_logits(server, PROMPTS[2], greedy.token_ids)
    assert greedy.token_ids == logits.argmax(-1).tolist() and len(greedy.token_ids) == 8
    stop = greedy.token_ids[3]
    first = greedy.token_ids.index(stop)
    stopped = asyncio.run(
        server.generate(PROMPTS[2], dict(temperature=0, max_tokens=8, ignore_eos=True, stop_token_ids=[stop]), "s")
    )
    assert stopped.token_ids == greedy.token_ids[: first + 1] and stopped.stop_reason == "completed"
    assert stopped.log_probs is None  # not asked for


def test_the_model_eos_ends_a_response_unless_ignored(model_dir):
    """The model's eos id stops a response; ignore_eos=True (per request, or rollout.ignore_eos) generates through it."""
    server = make_server(model_dir, topk=None)
    ends = asyncio.run(
        server.generate(PROMPTS[1], dict(temperature=0, max_tokens=16, ignore_eos=True, stop_token_ids=[]), "a")
    )
    server.engine.eos_token_ids = (ends.token_ids[2],)
    cut = asyncio.run(server.generate(PROMPTS[1], dict(temperature=0, max_tokens=16), "b"))
    assert cut.token_ids == ends.token_ids[: ends.token_ids.index(ends.token_ids[2]) + 1]
    object.__setattr__(server.config, "ignore_eos", True)  # rollout.ignore_eos: the default of every request
    assert asyncio.run(server.generate(PROMPTS[1], dict(temperature=0, max_tokens=16), "c")).token_ids == ends.token_ids
    assert EXTRA_IDS not in cut.extra_fields  # Top-K off: no rows


def test_abort_returns_the_tokens_so_far_and_pauses_until_resume(model_dir):
    """abort_all_requests stops a running request at the next step: stop_reason 'aborted', its tokens, log-probs and
    top-K rows so far (verl's resume loop sends prompt + those tokens again); a request sent while paused waits for
    resume_generation; abort_request stops one request."""
    server = make_server(model_dir)

    async def scenario():
        params = dict(temperature=1.0, max_tokens=40, logprobs=True, ignore_eos=True)
        running = asyncio.create_task(server.generate(PROMPTS[0], dict(params), "long"))
        while not server.engine._running or not server.engine._running[0].tokens:
            await asyncio.sleep(0.001)
        result = await server.abort_all_requests()
        cut = await running
        late = asyncio.create_task(server.generate(PROMPTS[1], dict(params, max_tokens=3), "late"))
        await asyncio.sleep(0.05)
        waited = not late.done()
        await server.resume_generation()
        late_out = await late
        single = asyncio.create_task(server.generate(PROMPTS[3], dict(params), "one"))
        while not server.engine._running:
            await asyncio.sleep(0.001)
        answer = await server.abort_request("one")
        return result, cut, waited, late_out, answer, await single, await server.abort_request("gone")

    result, cut, waited, late, answer, single, missing = asyncio.run(scenario())
    assert result["request_ids"] == ["long"] and result["aborted_count"] == 1
    assert cut.stop_reason == "aborted" and 0 < len(cut.token_ids) < 40
    assert len(cut.log_probs) == len(cut.token_ids) == cut.extra_fields[EXTRA_IDS].shape[0]
    assert waited and late.stop_reason == "completed" and len(late.token_ids) == 3
    assert answer["aborted"] and single.stop_reason == "aborted" and len(single.token_ids) < 40
    assert not missing["aborted"]


def test_reject_while_paused_fails_over(model_dir):
    """abort_all_requests(reject_request=True): a request arriving behind the closed gate is answered at once,
    aborted with no tokens, instead of waiting (verl's hybrid replica leaving the load balancer)."""
    server = make_server(model_dir)

    async def scenario():
        await server.abort_all_requests(reject_request=True)
        return await asyncio.wait_for(server.generate(PROMPTS[0], dict(max_tokens=4), "x"), timeout=5)

    out = asyncio.run(scenario())
    assert out.stop_reason == "aborted" and out.token_ids == []


def test_sampling_is_reproducible_per_request(model_dir):
    """Two servers with the same seed and weight version sample the same tokens for the same prompts, whatever the
    batch composition; the n samples of one prompt differ (a restarted run samples what the uninterrupted one did)."""
    params = dict(temperature=1.0, max_tokens=12, ignore_eos=True)
    first = make_server(model_dir)
    asyncio.run(first.set_global_steps(3))
    together = asyncio.run(_generate_all(first, [PROMPTS[0], PROMPTS[0], PROMPTS[4]], params))
    second = make_server(model_dir)
    asyncio.run(second.set_global_steps(3))
    alone = [asyncio.run(second.generate(p, dict(params), "y")) for p in (PROMPTS[0], PROMPTS[0], PROMPTS[4])]
    assert [o.token_ids for o in together] == [o.token_ids for o in alone]
    assert together[0].token_ids != together[1].token_ids


class _Handle:
    """An hf server object behind the `generate.remote(...)` of a Ray actor handle, in this process."""

    def __init__(self, server):
        self.generate = types.SimpleNamespace(remote=lambda **kwargs: server.generate(**kwargs))


class _Client(llm_server.LLMServerClient):
    """verl's `LLMServerClient.generate` (the plugin's patch on it included), routed to one server object."""

    def __init__(self, rollout_name, server):
        super().__init__(OmegaConf.create({"actor_rollout_ref": {"rollout": {"name": rollout_name}}}))
        self.handle = _Handle(server)

    async def _acquire_server(self, request_id, **extra):
        return "server", self.handle

    def _release_server(self, server_id, request_id=None):
        pass


def _samples_of_one_prompt(client, order):
    """The samples of PROMPTS[0] with verl's batch indices (`priority`) `order`, sent together in that order; the
    token ids by index."""

    async def send():
        return await asyncio.gather(
            *[
                client.generate(
                    f"r{index}",
                    prompt_ids=PROMPTS[0],
                    priority=index,
                    sampling_params=dict(temperature=1.0, max_tokens=12, ignore_eos=True),
                )
                for index in order
            ]
        )

    return dict(zip(order, [o.token_ids for o in asyncio.run(send())]))


def test_a_sample_draws_the_same_tokens_whatever_order_the_samples_of_its_prompt_arrive_in(model_dir):
    """verl's client (patched) hands the hf server each sample's batch index, and the server seeds from it: the
    samples of one prompt sent in the opposite order draw the same tokens for the same index (verl's agent loop sends
    them from concurrent tasks, in an order that varies from run to run). Through a client for vLLM (which gets
    no index from the patch), the hf server can only go by arrival: the samples swap, which is what made a resumed
    cpu_tiny run's step 3 differ from the uninterrupted run's."""
    servers = [make_server(model_dir, topk=None) for _ in range(4)]
    for server in servers:
        asyncio.run(server.set_global_steps(3))
    forward = _samples_of_one_prompt(_Client("hf", servers[0]), [0, 1, 2])
    backward = _samples_of_one_prompt(_Client("hf", servers[1]), [2, 1, 0])
    assert forward == backward and len({tuple(tokens) for tokens in forward.values()}) == 3
    by_arrival = _samples_of_one_prompt(_Client("vllm", servers[2]), [0, 1, 2])
    reversed_arrival = _samples_of_one_prompt(_Client("vllm", servers[3]), [2, 1, 0])
    assert by_arrival[0] == reversed_arrival[2] != reversed_arrival[0]


def _sample_on(server, trajectory_info, session_id):
    """One sample of PROMPTS[0] as verl 0.9.1's v1 agent loop sends it (priority 0 for every sample: its
    `_run_prompt` never sets one), inside the agent loop's trajectory (the plugin's `_run_agent_loop` patch)."""

    async def send():
        with agent_loop.trajectory(agent_loop.sample_identity(trajectory_info, {"session_id": session_id})):
            return await _Client("hf", server).generate(
                "r",
                prompt_ids=PROMPTS[0],
                priority=0,
                sampling_params=dict(temperature=1.0, max_tokens=12, ignore_eos=True),
            )

    return asyncio.run(send()).token_ids


def test_the_samples_of_a_prompt_differ_on_two_replicas_and_repeat_after_a_restart(model_dir):
    """Issue 34.1: the n samples of a prompt served by two replicas (each at its first request for that prompt) are
    distinct draws; a fresh pair of servers (a resumed run) draws the same tokens for the same sample, on either
    replica. verl's `priority` (0 for every sample of the v1 agent loop) cannot tell them apart."""
    servers = [make_server(model_dir, topk=None) for _ in range(4)]
    for server in servers:
        asyncio.run(server.set_global_steps(3))
    info = {"step": 3, "sample_index": 7, "rollout_n": 0, "validate": False}
    first = [_sample_on(servers[0], info, 0), _sample_on(servers[1], info, 1)]
    again = [_sample_on(servers[3], info, 0), _sample_on(servers[2], info, 1)]  # replicas swapped
    assert first[0] != first[1] and first == again


def test_weights_loaded_change_what_is_sampled(model_dir):
    """load_weights copies the pushed tensors into the model (an unknown name or shape is an error)."""
    server = make_server(model_dir, topk=None)
    before = asyncio.run(server.generate(PROMPTS[0], dict(temperature=0, max_tokens=6, ignore_eos=True), "a"))
    state = {k: torch.randn_like(v) for k, v in server.engine.model.state_dict().items()}
    assert asyncio.run(server.load_weights(list(state.items()))) == len(state)
    asyncio.run(server.finish_weight_update(global_steps=5, loaded=len(state)))
    assert server.global_steps == 5
    weights = asyncio.run(server.get_weights())
    assert all(torch.equal(weights[k], v) for k, v in state.items())
    after = asyncio.run(server.generate(PROMPTS[0], dict(temperature=0, max_tokens=6, ignore_eos=True), "b"))
    assert after.token_ids != before.token_ids and after.extra_fields["global_steps"] == 5
    with pytest.raises(KeyError, match="not_a_weight"):
        asyncio.run(server.load_weights([("not_a_weight", torch.zeros(1))]))


@pytest.mark.parametrize(
    "params, match",
    [
        ({"presence_penalty": 0.5}, "presence_penalty=0.5"),
        ({"repetition_penalty": 1.2}, "repetition_penalty=1.0"),
        ({"top_p": 0.0}, "rollout.top_p"),
        ({"top_k": 0}, "rollout.top_k"),
        ({"temperature": -1.0}, "rollout.temperature"),
    ],
)
def test_a_setting_the_server_cannot_honour_is_one_clear_error(server, params, match):
    with pytest.raises(HFRolloutError, match=match):
        asyncio.run(server.generate(PROMPTS[0], dict(params, max_tokens=4), "bad"))


def test_a_prompt_longer_than_the_context_is_one_clear_error(server):
    with pytest.raises(HFRolloutError, match="max_prompt_length"):
        asyncio.run(server.generate(list(range(2, 66)), dict(max_tokens=4), "long"))


def test_sample_next_on_peaked_bf16_rows():
    """A row whose top-1 has probability 1 - 1e-9 (bf16 logits, the rest down to log-prob -100): the top-1 is drawn
    with log-prob ~0 under every truncation; the top-K row reports the tail's tiny log-probs, finite."""
    logits = torch.full((3, 64), -100.0)
    logits[:, 5] = 0.0
    logits[:, 6] = -20.7  # exp(-20.7) ~ 1e-9
    logits = logits.to(torch.bfloat16).float()
    noise = torch.ones(3, 64)
    noise[:, 5] = 1e6  # the top-1's draw as unlucky as a float draw of Exp(1) gets: it still wins
    tokens, logprobs, topk = sample_next(
        logits, torch.tensor([1.0, 0.5, 0.0]), torch.tensor([-1, 2, -1]), torch.tensor([1.0, 0.9, 1.0]), noise, 4
    )
    assert tokens.tolist() == [5, 5, 5]
    assert (logprobs.abs() < 1e-6).all()
    assert topk[0][:, :2].tolist() == [[5, 6]] * 3 and torch.isfinite(topk[1]).all()
    assert float(topk[1][0, 1]) == pytest.approx(-20.7, abs=0.1)


def test_top_k_keeps_logits_tied_with_the_kth_as_vllm_does():
    """vLLM's top-k is a threshold (logits below the k-th largest dropped): logits [3, 2, 2, 1, 0] with top_k=2
    sample from {0.576, 0.212, 0.212}, not {0.731, 0.269}; the row's log-probs follow. 40,000 draws: each kept
    token's frequency within 0.01 of its probability (about 4 standard errors), the dropped ones never drawn, even
    where their noise is the smallest of the row."""
    rows = 40_000
    logits = torch.tensor([[3.0, 2.0, 2.0, 1.0, 0.0]]).repeat(rows, 1)
    noise = torch.empty(rows, 5).exponential_(generator=torch.Generator().manual_seed(0))
    noise[:10, 3:] = 0.0  # a zero draw (Exp(1) in floats can return one) on a dropped token
    tokens, logprobs, _ = sample_next(logits, torch.ones(rows), torch.full((rows,), 2), torch.ones(rows), noise, None)
    kept = torch.softmax(torch.tensor([3.0, 2.0, 2.0]), dim=0)
    frequency = torch.bincount(tokens, minlength=5).float() / rows
    assert frequency[3:].tolist() == [0.0, 0.0]
    assert frequency[:3].tolist() == pytest.approx(kept.tolist(), abs=0.01)
    assert logprobs[:8].tolist() == pytest.approx([math.log(kept[t]) for t in tokens[:8].tolist()], abs=1e-6)
    assert float(kept[0]) == pytest.approx(0.576, abs=1e-3) and float(kept[1]) == pytest.approx(0.212, abs=1e-3)


def test_a_draw_does_not_turn_on_the_last_bits_of_the_logits():
    """The same noise with logits moved by 1e-5 (what weights that differ in their last bits, from another summation
    order of the previous update, do to a forward) draws the same token, on near-uniform rows (a random-init
    model's) where many logits nearly tie: the exponential race changes its pick only where two scores tie. (The
    inverse CDF over sorted probabilities, the sampler before, moved a boundary whenever two near-equal logits swapped
    ranks: it changed 248 of these 4,096 draws, and a resumed cpu_tiny run's step 3 from the uninterrupted run's.)"""
    generator = torch.Generator().manual_seed(1)
    rows, vocab = 4096, 1024
    logits = torch.randn(rows, vocab, generator=generator) * 0.05
    perturbed = logits + 1e-5 * torch.randn(rows, vocab, generator=generator)
    noise = torch.empty(rows, vocab).exponential_(generator=generator)
    ones, all_k = torch.ones(rows), torch.full((rows,), -1)
    first, _, _ = sample_next(logits, ones, all_k, ones, noise, None)
    second, _, _ = sample_next(perturbed, ones, all_k, ones, noise, None)
    assert int((first != second).sum()) == 0


def test_parse_defaults():
    settings = parse_sampling_params({"temperature": None, "logprobs": True}, 9)
    assert (settings.temperature, settings.top_p, settings.top_k, settings.max_tokens) == (1.0, 1.0, -1, 9)


def _push(server, named, **kwargs):
    """One weight push as the plugin's adapter makes it: the tensors in one bucket, then finish_weight_update."""
    loaded = asyncio.run(server.load_weights(list(named), **kwargs))
    asyncio.run(server.finish_weight_update(global_steps=2, loaded=loaded, **kwargs))
    return loaded


def test_lora_pushes_as_verl_makes_them_to_vllm_give_the_adapted_model(model_dir):
    """Issue 34.3: with model.lora_rank > 0 verl pushes the frozen base once, LoRA-targeted weights under vLLM's
    LoRA-layer names (`...q_proj.base_layer.weight`, its `replace_lora_wrapper`), then PEFT's adapter tensors with
    `peft_config` at every push. The hf rollout then generates with base + alpha/r x B @ A: its logits equal the
    PEFT model's own, and a second adapter push replaces the first (merged onto the base, not onto the last merge)."""
    from peft import LoraConfig, get_peft_model
    from peft.utils.save_and_load import get_peft_model_state_dict
    from transformers import AutoModelForCausalLM
    from verl.utils.fsdp_utils import replace_lora_wrapper

    from verl_dppo.rehearsal.hf_rollout.weights import lora_settings

    base = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    peft_config = LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", init_lora_weights=False)
    torch.manual_seed(1)
    peft_model = get_peft_model(base, peft_config)
    server = make_server(model_dir, topk=None)
    base_names = {
        name.replace("_fsdp_wrapped_module.", "").replace(".base_layer", ""): tensor
        for name, tensor in peft_model.base_model.model.state_dict().items()
        if "lora_" not in name
    }
    config = peft_model.peft_config["default"]
    pushed = [(replace_lora_wrapper(name, config), tensor) for name, tensor in base_names.items()]
    assert any(".base_layer." in name for name, _ in pushed)
    _push(server, pushed)  # base sync: base_sync_done=False, no adapter
    ids = torch.tensor([PROMPTS[0]])
    for _ in range(2):
        with torch.no_grad():
            for name, param in peft_model.named_parameters():
                if "lora_" in name:
                    param.add_(0.05 * torch.randn_like(param))
            expected = peft_model(input_ids=ids).logits
        adapter = list(get_peft_model_state_dict(peft_model).items())
        assert all(name.startswith("base_model.model.") and ".lora_" in name for name, _ in adapter)
        _push(server, adapter, lora=lora_settings(config))
        with torch.no_grad():
            got = server.engine.model(input_ids=ids).logits
        assert torch.allclose(got, expected, atol=1e-4), (got - expected).abs().max()
    with pytest.raises(ValueError, match="use_dora"):
        lora_settings(LoraConfig(r=8, lora_alpha=16, use_dora=True))


def test_moe_experts_pushed_per_expert_land_in_transformers_fused_tensors(tmp_path):
    """Issue 34.3: transformers 5 keeps Qwen3-MoE experts fused (`mlp.experts.gate_up_proj` [E, 2I, H], `down_proj`
    [E, H, I]); verl's actor exports them per expert for vLLM (`unfuse_moe_params`: `mlp.experts.<e>.gate_proj.
    weight`). The hf rollout puts each back in its slice: after the push its model's state equals the actor's."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    from verl.workers.engine.fsdp.utils import unfuse_moe_params

    config = Qwen3MoeConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=64,
        eos_token_id=1,
        pad_token_id=0,
        bos_token_id=None,
    )
    torch.manual_seed(0)
    Qwen3MoeForCausalLM(config).save_pretrained(tmp_path)
    torch.manual_seed(1)
    actor = Qwen3MoeForCausalLM(config)
    exported = list(unfuse_moe_params(actor.state_dict().items(), "qwen3_moe"))
    assert any(".mlp.experts.3.up_proj.weight" in name for name, _ in exported)
    server = make_server(tmp_path, topk=None)
    assert _push(server, exported) == len(exported)
    state = server.engine.model.state_dict()
    assert all(torch.equal(state[name], tensor) for name, tensor in actor.state_dict().items())
    with pytest.raises(KeyError, match="4 experts"):
        asyncio.run(server.load_weights([("model.layers.0.mlp.experts.4.gate_proj.weight", exported[0][1])]))


def test_every_sample_of_the_legacy_agent_loop_has_its_own_identity_however_the_batch_is_split():
    """Issue 40.4: verl's legacy agent loop (trainer.use_v1=False) splits the batch (4 prompts x 4 samples) into one
    equal chunk per agent-loop worker and counts `rollout_n` within a chunk, so with 8 workers (chunks of 2) each
    prompt straddles two chunks and repeats its counts; `priority`, set over the whole batch before the split, tells
    those samples apart: 16 distinct identities for 1, 8 or 16 workers (each the same at every launch), none shared
    with the next step, and the v1 loop's (session ids, priority 0) distinct too."""
    import numpy as np

    from verl import DataProto
    from verl.experimental.agent_loop.agent_loop import get_trajectory_info

    def identities(workers: int, step: int) -> list:
        batch = DataProto.from_dict(non_tensors={"index": np.repeat(np.arange(10, 14), 4)})
        batch.non_tensor_batch["priority"] = np.arange(len(batch), dtype=np.int64)  # as AgentLoopManager does
        out, counts = [], []
        for chunk in batch.chunk(workers):
            infos = asyncio.run(get_trajectory_info(step, chunk.non_tensor_batch["index"].tolist(), False))
            for i, info in enumerate(infos):
                kwargs = {k: v[i] for k, v in chunk.non_tensor_batch.items()}  # as the legacy loop passes them
                out.append(agent_loop.sample_identity(info, kwargs))
                counts.append((info["sample_index"], info["rollout_n"]))
        assert workers == 1 or len(set(counts)) < len(counts)  # the chunk-local counts repeat: what this is about
        return out

    for workers in (1, 8, 16):
        once = identities(workers, step=3)
        assert len(set(once)) == 16 and identities(workers, step=3) == once, workers
        assert not set(identities(workers, step=4)) & set(once)
    info = {"step": 3, "sample_index": 10, "rollout_n": 0, "validate": False}
    v1 = [agent_loop.sample_identity(info, {"session_id": i, "priority": 0}) for i in range(4)]
    assert len(set(v1)) == 4


def _moe_dir(path):
    """A random-init Qwen3-MoE (4 experts, top-2; layer 1 dense) saved at `path`."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=64,
        eos_token_id=1,
        pad_token_id=0,
        bos_token_id=None,
        decoder_sparse_step=1,
        mlp_only_layers=[1],
        initializer_range=0.3,
    )
    torch.manual_seed(0)
    Qwen3MoeForCausalLM(config).save_pretrained(path)
    return path


def _check_routes(model, fed: list[int], routes) -> None:
    """`routes` are, row for row, the experts the model's own routers choose for the tokens `fed`, in one uncached,
    unpadded forward of the whole sequence; the dense layer's rows are zeros."""
    routers = [(i, layer.mlp.gate) for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "gate")]
    assert [i for i, _ in routers] == [0, 2]  # layer 1 is dense (mlp_only_layers): its rows stay zero
    assert routes.dtype == np.int16 and routes.shape == (len(fed), 3, 2), (routes.shape, len(fed))
    chosen = {}
    hooks = [router.register_forward_hook(lambda _m, _i, o, i=i: chosen.__setitem__(i, o[2])) for i, router in routers]
    with torch.no_grad():
        model(input_ids=torch.tensor([fed]))
    for hook in hooks:
        hook.remove()
    for i, _ in routers:
        assert np.array_equal(np.sort(routes[:, i], -1), np.sort(chosen[i].numpy(), -1)), i
    assert not routes[:, 1].any()


def test_the_routes_returned_are_the_experts_each_fed_token_was_routed_to(tmp_path, model_dir):
    """Issue 52: with enable_rollout_routing_replay the hf rollout returns `routed_experts` as vLLM does ([prompt +
    response - 1, layers, top-k] int16: every token it fed through the model), batched with left padding and a KV
    cache; each row equals the experts the model's own routers choose for that token in one uncached, unpadded
    forward of the whole sequence. Without the setting, none; a dense model with it is one clear error."""
    server = make_server(_moe_dir(tmp_path), topk=None, enable_rollout_routing_replay=True)
    outputs = asyncio.run(_generate_all(server, PROMPTS, {"temperature": 1.0, "max_tokens": 6, "ignore_eos": True}))
    for prompt, out in zip(PROMPTS, outputs):
        _check_routes(server.engine.model, list(prompt) + list(out.token_ids[:-1]), out.routed_experts)
    plain = make_server(tmp_path, topk=None)
    (out,) = asyncio.run(_generate_all(plain, PROMPTS[:1], {"temperature": 1.0, "max_tokens": 3}))
    assert out.routed_experts is None
    with pytest.raises(HFRolloutError, match="a dense model routes nothing"):
        make_server(model_dir, topk=None, enable_rollout_routing_replay=True)


def test_routes_after_an_abort_and_resume_merge_as_vllms_do(tmp_path, monkeypatch):
    """Issue 72.3: an aborted request returns prompt + T - 1 route rows, as vLLM does (not the row of the token the
    cut step fed), so verl's own partial-rollout merge (`FullyAsyncLLMServerClient.generate`: the first call's
    rows, then each resumed call's last T rows) lines up every row with its token: the merged routes are those of
    one forward of the whole sequence."""
    from omegaconf import OmegaConf

    from verl.workers.rollout import llm_server

    server = make_server(_moe_dir(tmp_path), topk=None, enable_rollout_routing_replay=True)
    calls = []

    async def to_this_server(self, request_id, *, prompt_ids, sampling_params, **kwargs):
        calls.append(len(prompt_ids))
        return await server.generate(prompt_ids, sampling_params, request_id)

    monkeypatch.setattr(llm_server.LLMServerClient, "generate", to_this_server)
    client = object.__new__(llm_server.FullyAsyncLLMServerClient)
    client.config = OmegaConf.create({"actor_rollout_ref": {"rollout": {"response_length": 40}}})
    prompt = list(PROMPTS[0])

    async def scenario():
        params = dict(temperature=1.0, max_tokens=40, ignore_eos=True)
        running = asyncio.create_task(client.generate("r", prompt_ids=prompt, sampling_params=params))
        while not server.engine._running or len(server.engine._running[0].tokens) < 3:
            await asyncio.sleep(0.001)
        await server.abort_all_requests()
        await asyncio.sleep(0.05)
        await server.resume_generation()
        return await running

    out = asyncio.run(scenario())
    assert len(calls) == 2 and calls[1] > len(prompt), calls  # cut after some tokens, then resumed
    assert len(out.token_ids) == 40
    _check_routes(server.engine.model, prompt + list(out.token_ids[:-1]), out.routed_experts)
