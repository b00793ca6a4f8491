"""Every loss mode under verl 0.9.1's asynchronous v1 trainers (`trainer.v1.trainer_mode=colocate_async` /
`separate_async`, issue 14, parts 1-3).

1. What `PPOTrainerSeparateAsync.__init__` asserts at start (`trainer/ppo/v1/trainer_separate_async.py`: the batch
   split `data.train_batch_size == parameter_sync_step * ppo_mini_batch_size`, the rollout's own GPUs, a checkpoint
   engine that can reach them, a reward model on its own pool, no hybrid switch with disaggregation on the hybrid
   engine) and what the DPPO modes need there (the rollout's per-token log-probs) is refused by the run-config check,
   one line naming the key, on a composed recipe and through `verl-dppo run ... --dry-run` (exit 2); where verl turns
   the switch off and runs (no hybrid engine), the check warns.
2. `anchor=recompute` under an async trainer warns once, naming the setting.
3. A response aborted by a weight update and resumed (verl's real `FullyAsyncLLMServerClient.generate` loop) keeps
   exactly one top-K row per generated token, in order, each from the reply that generated it, whether the replies
   come shaped as vLLM's or as SGLang's outputs (through the plugin's own extraction of each).
The recipes switch trainer with `trainer_mode` (recipes/trainer_mode/, `verl-dppo run --trainer-mode MODE`).
"""

from __future__ import annotations

import asyncio
import copy
import inspect
import logging
import os
import subprocess
import sys

import numpy as np
import pytest
from omegaconf import OmegaConf
from vllm_fixtures import _Logprob as Logprob
from test_topk_token_builders import PROMPT, assert_rows_follow_the_log_probs, compose_config, family_named
from verl.experimental.agent_loop.agent_loop import DictConfigWrap
from verl.experimental.agent_loop.single_turn_agent_loop import SingleTurnAgentLoop
from verl.utils.dataset.rl_dataset import RLHFDataset
from verl.workers.rollout import llm_server
from verl.workers.rollout.replica import TokenOutput

from verl_dppo.launch.compose import compose_recipe, validate_recipe
from verl_dppo.patches._server_common import EXTRA_IDS, EXTRA_LOGPROBS
from verl_dppo.patches.sglang_async_server import extract_sglang_topk
from verl_dppo.patches.vllm_async_server import extract_vllm_topk
from verl_dppo.patches.agent_loop import trajectory
from verl_dppo.plugin import run_config
from verl_dppo.plugin import log_once
from verl_dppo.plugin.run_config import RunConfigError, check_run_config

SETUP = "sanity_1p5b"  # data.train_batch_size 64 = verl's default parameter_sync_step 4 x ppo_mini_batch_size 16
# One recipe per loss mode the plugin registers.
METHOD_OF_MODE = {
    "dppo_binary_tv": "dppo_binary_tv",
    "dppo_binary_kl": "dppo_binary_kl",
    "dppo_topk_tv": "dppo_topk_tv",
    "dppo_topk_kl": "dppo_topk_kl",
    "grpo_clip": "grpo_clip_higher",
    "pg_is": "pg_is",
    "troll": "troll",
}
_cache: dict = {}


def composed(method: str, trainer_mode: str = "separate_async"):
    """The recipe composed with the recipes' switch to an async trainer (recipes/trainer_mode/); callers get their
    own copy."""
    if (method, trainer_mode) not in _cache:
        _cache[method, trainer_mode] = compose_recipe(SETUP, method, trainer_mode=trainer_mode)
    return copy.deepcopy(_cache[method, trainer_mode])


def separate_async(method: str):
    return composed(method, "separate_async")


def with_values(config, **values):
    for key, value in values.items():
        OmegaConf.update(config, key.replace("__", "."), value, force_add=True)
    return config


@pytest.mark.parametrize("mode", sorted(METHOD_OF_MODE))
def test_every_loss_mode_composes_under_both_async_trainers(mode):
    """The recipes run under either async trainer with the recipes' switch alone: verl's checks pass, and the
    run-config check neither refuses nor warns (the recipes anchor on the rollout, bypass mode on)."""
    for trainer_mode in ("separate_async", "colocate_async"):
        config = composed(METHOD_OF_MODE[mode], trainer_mode)
        assert config.actor_rollout_ref.actor.policy_loss.loss_mode == mode
        assert config.trainer.v1.trainer_mode == config.dppo.trainer_mode == trainer_mode
        assert config.actor_rollout_ref.rollout.calculate_log_probs and config.algorithm.rollout_correction.bypass_mode
        # the staleness diagnostics count what verl's replay buffer would not keep
        assert config.actor_rollout_ref.actor.policy_loss.max_off_policy_threshold == 8
        validate_recipe(config)
        assert run_config.async_trainer_mode(config) == trainer_mode
        assert check_run_config(config) == []


@pytest.mark.parametrize(
    "values, key",
    [
        # PPOTrainerSeparateAsync.__init__: weights reach the rollout every parameter_sync_step mini-batches
        ({"data.train_batch_size": 48}, "data.train_batch_size=64"),
        ({"trainer.v1.separate_async.parameter_sync_step": 2}, "data.train_batch_size=32"),
        ({"actor_rollout_ref.actor.ppo_mini_batch_size": 32}, "data.train_batch_size=128"),
        # ... the standalone rollout pool (verl's default rollout.nnodes is 0)
        ({"actor_rollout_ref.rollout.nnodes": 0}, "actor_rollout_ref.rollout.nnodes > 0"),
        ({"actor_rollout_ref.rollout.n_gpus_per_node": 0}, "actor_rollout_ref.rollout.n_gpus_per_node > 0"),
        # ... weights pushed to that pool (verl's default backend is naive)
        (
            {"actor_rollout_ref.rollout.checkpoint_engine.backend": "naive"},
            "actor_rollout_ref.rollout.checkpoint_engine.backend=nccl",
        ),
        ({"reward.reward_model.enable": True}, "reward.reward_model.enable_resource_pool=True"),
        (
            {
                "trainer.v1.separate_async.hybrid_rollout.enable_switch": True,
                "actor_rollout_ref.rollout.disaggregation.enabled": True,
            },
            "actor_rollout_ref.rollout.disaggregation.enabled",
        ),
    ],
)
def test_separate_async_start_up_asserts_are_refused_naming_the_key(values, key):
    config = separate_async("dppo_binary_tv")
    config.trainer.v1.separate_async.parameter_sync_step = 4  # set by hand: no longer follows the batch
    for name, value in values.items():
        OmegaConf.update(config, name, value, force_add=True)
    with pytest.raises(RunConfigError) as error:
        check_run_config(config)
    message = str(error.value)
    assert key in message and "trainer.v1.trainer_mode=separate_async" in message and "\n" not in message
    # verl's own check is the same condition: its assert fires on exactly these configs (the batch split)
    if "data.train_batch_size" in key:
        sync_step = config.trainer.v1.separate_async.parameter_sync_step
        assert config.data.train_batch_size != sync_step * config.actor_rollout_ref.actor.ppo_mini_batch_size


def verl_separate_async_init(config, caplog) -> str:
    """What verl 0.9.1's own `PPOTrainerSeparateAsync.__init__` does with `config` (it needs no Ray): "raises",
    "warns" (logs that it turns the hybrid switch off, and runs with the switch off) or "runs"."""
    from verl.trainer.ppo.v1.trainer_separate_async import PPOTrainerSeparateAsync

    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="verl.trainer.ppo.v1.trainer_separate_async"):
        try:
            trainer = PPOTrainerSeparateAsync(copy.deepcopy(config))
        except ValueError:
            return "raises"
    if any("enable_switch is ignored" in record.getMessage() for record in caplog.records):
        assert not trainer.hybrid_rollout_config.enable_switch
        return "warns"
    return "runs"


def plugin_check(config) -> str:
    try:
        warnings = check_run_config(config)
    except RunConfigError as error:
        message = str(error)
        assert "\n" not in message and "trainer.v1.separate_async.hybrid_rollout.enable_switch" in message
        assert "actor_rollout_ref.rollout.disaggregation.enabled" in message
        return "raises"
    switch = [w for w in warnings if "hybrid_rollout.enable_switch=True is ignored" in w]
    assert len(switch) == len(warnings) <= 1  # the recipes raise no other warning
    assert all("actor_rollout_ref.hybrid_engine=False" in w and "set enable_switch=False" in w for w in switch)
    return "warns" if switch else "runs"


@pytest.mark.parametrize("method", ["dppo_topk_kl", "vanilla"])
def test_the_hybrid_switch_is_refused_exactly_where_verls_init_raises(method, caplog):
    """Every combination of actor_rollout_ref.hybrid_engine (True, False, None, unset: verl reads it as
    `bool(get("hybrid_engine", True))`), trainer.v1.separate_async.hybrid_rollout.enable_switch and
    actor_rollout_ref.rollout.disaggregation.enabled, run through verl's own `PPOTrainerSeparateAsync.__init__`:
    the plugin refuses where verl raises, warns where verl turns the switch off and runs, and is silent otherwise
    (any loss mode: these are verl's checks)."""
    from omegaconf import open_dict

    table = {}
    for hybrid_engine in (True, False, None, "unset"):
        for enable_switch in (True, False):
            for disaggregation in (True, False):
                config = separate_async("dppo_topk_kl")
                config.actor_rollout_ref.actor.policy_loss.loss_mode = method
                config.trainer.v1.separate_async.hybrid_rollout.enable_switch = enable_switch
                config.actor_rollout_ref.rollout.disaggregation.enabled = disaggregation
                with open_dict(config.actor_rollout_ref):
                    if hybrid_engine == "unset":
                        del config.actor_rollout_ref["hybrid_engine"]
                    else:
                        config.actor_rollout_ref.hybrid_engine = hybrid_engine
                case = (hybrid_engine, enable_switch, disaggregation)
                table[case] = verl_separate_async_init(config, caplog)
                assert plugin_check(config) == table[case], case
    # verl's table: it raises only with the hybrid engine on (as by default); without it, it turns the switch off
    assert {case for case, outcome in table.items() if outcome == "raises"} == {
        (True, True, True),
        ("unset", True, True),
    }
    assert {case for case, outcome in table.items() if outcome == "warns"} == {
        (off, True, disaggregation) for off in (False, None) for disaggregation in (True, False)
    }


@pytest.mark.parametrize("setup, sync_step", [("sanity_1p5b", 4), ("efficiency_1p7b", 4), ("moe_base", 8)])
def test_the_switch_pushes_weights_once_per_training_step_whatever_the_setups_batch(setup, sync_step):
    """recipes/trainer_mode/separate_async.yaml: parameter_sync_step = train_batch_size / ppo_mini_batch_size, so
    verl's assert holds for every setup, and follows a changed batch; a batch that does not split is one line."""
    config = compose_recipe(setup, "dppo_binary_tv", trainer_mode="separate_async")
    assert config.trainer.v1.separate_async.parameter_sync_step == sync_step
    assert check_run_config(config) == []
    config = compose_recipe(
        setup,
        "dppo_binary_tv",
        ["data.train_batch_size=96", "actor_rollout_ref.actor.ppo_mini_batch_size=32"],
        trainer_mode="separate_async",
    )
    assert config.trainer.v1.separate_async.parameter_sync_step == 3 and check_run_config(config) == []
    config.data.train_batch_size = 100
    with pytest.raises(Exception, match="not a whole number"):
        validate_recipe(config)


def test_the_bare_trainer_mode_key_is_refused_pointing_at_the_switch():
    config = compose_recipe(SETUP, "dppo_binary_tv", ["trainer.v1.trainer_mode=colocate_async"])
    with pytest.raises(Exception, match="--trainer-mode colocate_async") as error:
        validate_recipe(config)
    assert "\n" not in str(error.value)
    with pytest.raises(Exception, match="unknown trainer mode 'async'.*separate_async"):
        compose_recipe(SETUP, "dppo_binary_tv", trainer_mode="async")


def test_verls_assert_is_checked_for_every_loss_mode_not_only_ours():
    """verl's start-up asserts hold for any loss mode; the plugin's own needs only for its modes."""
    config = with_values(
        separate_async("dppo_binary_tv"), data__train_batch_size=48, trainer__v1__separate_async__parameter_sync_step=4
    )
    config.actor_rollout_ref.actor.policy_loss.loss_mode = "vanilla"
    with pytest.raises(RunConfigError, match="data.train_batch_size"):
        check_run_config(config)
    # colocate_async asserts none of them; sync and the v0 trainer ignore trainer.v1 altogether
    for values in (
        {"trainer.v1.trainer_mode": "colocate_async"},
        {"trainer.v1.trainer_mode": "sync"},
        {"trainer.use_v1": False},
    ):
        config = with_values(
            separate_async("dppo_binary_tv"),
            data__train_batch_size=48,
            trainer__v1__separate_async__parameter_sync_step=4,
        )
        for name, value in values.items():
            OmegaConf.update(config, name, value)
        assert check_run_config(config) == []


@pytest.mark.parametrize("trainer_mode", ["colocate_async", "separate_async"])
def test_async_dppo_without_rollout_log_probs_is_refused(trainer_mode):
    """A resumed response's mu exists only as the rollout reported it, token by token: without
    calculate_log_probs nothing can stand in for it (sync mode, decoupled, only warns)."""
    config = with_values(
        separate_async("dppo_binary_kl"),
        trainer__v1__trainer_mode=trainer_mode,
        algorithm__rollout_correction__bypass_mode=False,
        actor_rollout_ref__rollout__calculate_log_probs=False,
    )
    with pytest.raises(
        RunConfigError,
        match=rf"under trainer.v1.trainer_mode={trainer_mode} .*"
        r"set actor_rollout_ref.rollout.calculate_log_probs=True",
    ):
        check_run_config(config)
    config.trainer.v1.trainer_mode = "sync"
    assert len(check_run_config(config)) == 1  # the sync trainer's warning, as before
    config.actor_rollout_ref.actor.policy_loss.loss_mode = "vanilla"  # verl's own decoupled PPO: not ours
    config.trainer.v1.trainer_mode = trainer_mode
    assert check_run_config(config) == []


@pytest.mark.parametrize("trainer_mode", ["colocate_async", "separate_async"])
def test_bypass_without_rollout_log_probs_is_refused_for_every_loss_mode(trainer_mode):
    """verl's `_compute_old_log_prob` reads `rollout_log_probs` in bypass mode: refused before the run, any mode."""
    for method in ("dppo_binary_tv", "grpo_clip_higher"):
        config = with_values(composed(method, trainer_mode), actor_rollout_ref__rollout__calculate_log_probs=False)
        with pytest.raises(
            RunConfigError,
            match=r"bypass_mode=True .* set actor_rollout_ref.rollout.calculate_log_probs"
            r"=True",
        ):
            check_run_config(config)


def test_a_threshold_that_differs_from_verls_is_warned_naming_the_key(monkeypatch):
    """The actor counts samples older than what verl keeps only with verl's own threshold (the recipes copy it)."""
    monkeypatch.setattr(log_once, "_SEEN", set())
    config = composed("dppo_binary_tv", "separate_async")
    config.trainer.v1.sampler.max_off_policy_threshold = 4  # the recipes' copy follows verl's value
    assert config.actor_rollout_ref.actor.policy_loss.max_off_policy_threshold == 4
    assert check_run_config(config) == []
    config.actor_rollout_ref.actor.policy_loss.max_off_policy_threshold = None
    (warning,) = check_run_config(config)
    assert "set actor_rollout_ref.actor.policy_loss.max_off_policy_threshold=4" in warning
    config.trainer.v1.trainer_mode = "sync"  # no stale samples: nothing to count
    assert check_run_config(config) == []


def test_recompute_anchor_under_async_warns_once_naming_the_setting(caplog, monkeypatch):
    """Part 2: the decoupled anchor is the recomputed policy, not the versions that sampled the response."""
    monkeypatch.setattr(log_once, "_SEEN", set())
    config = composed("dppo_binary_kl_decoupled", "colocate_async")
    assert config.actor_rollout_ref.actor.policy_loss.anchor == "recompute"
    with caplog.at_level(logging.WARNING, logger="verl_dppo"):
        for _ in range(3):  # separate_async builds two server managers, each runs the check at launch
            warnings = check_run_config(config)
            assert len(warnings) == 1
            assert "policy_loss.anchor=recompute under trainer.v1.trainer_mode=colocate_async" in warnings[0]
            assert "set actor_rollout_ref.actor.policy_loss.anchor=rollout" in warnings[0].lower()
    logged = [r for r in caplog.records if "anchor=recompute under" in r.getMessage()]
    assert len(logged) == 1
    config.trainer.v1.trainer_mode = "sync"
    assert check_run_config(config) == []  # sync: the decoupled variant on purpose, no warning


def test_dry_run_refuses_in_one_line_and_warns_on_recompute(tmp_path):
    """The real command line: a refused async setting is exit 2 and one line; a warned one still prints the YAML."""
    env = dict(os.environ, DPPO_ROOT=str(tmp_path))
    refused = subprocess.run(
        [
            sys.executable,
            "-m",
            "verl_dppo.cli",
            "run",
            SETUP,
            "--method",
            "dppo_topk_kl",
            "--dry-run",
            "--trainer-mode",
            "separate_async",
            "trainer.v1.separate_async.parameter_sync_step=4",
            "data.train_batch_size=48",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert refused.returncode == 2, refused.stderr
    error_lines = [line for line in refused.stderr.splitlines() if "data.train_batch_size" in line]
    assert len(error_lines) == 1 and "data.train_batch_size=64" in error_lines[0], refused.stderr
    assert "Traceback" not in refused.stderr and refused.stdout == ""
    warned = subprocess.run(
        [
            sys.executable,
            "-m",
            "verl_dppo.cli",
            "run",
            SETUP,
            "--method",
            "dppo_binary_kl_decoupled",
            "--dry-run",
            "--trainer-mode",
            "colocate_async",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert warned.returncode == 0, warned.stderr
    assert warned.stderr.count("policy_loss.anchor=recompute under trainer.v1.trainer_mode=colocate_async") == 1
    assert "trainer_mode: colocate_async" in warned.stdout


# ------------------------------------------------------------------- part 3: top-K rows across partial rollouts

K = 3
ANSWER = "The answer is 5.<|im_end|>"
# (characters generated, stop reason, weights version): aborted by a weight update mid-response, an abort that
# generated nothing (the update landed before the next token), resumed twice under newer weights.
SEGMENTS = [(6, "aborted", 1), (0, "abort", 1), (7, "aborted", 2), (None, "completed", 3)]


class AbortingServer:
    """Stands in for the vLLM server (as the plugin's server patch leaves its reply): generates `ANSWER` in the
    segments above, each reply with its token ids, log-probs, `global_steps` and one top-K row per generated token
    in `extra_fields` (numpy [T, K]). Row of the n-th token generated under version v: ids [token, 1000 v + n, ...],
    log-probs [-n/64 - v/8, ...], so every row says which reply made it. `empty_rows`: the empty abort carries
    [0, K] rows (else none, as the vLLM / SGLang patches send for a reply without tokens)."""

    def __init__(self, tokenizer, empty_rows=False, engine=None):
        self.generate = self  # verl awaits `server.generate.remote(...)`
        self.answer = tokenizer.encode(ANSWER, add_special_tokens=False)
        self.empty_rows = empty_rows
        self.engine = engine
        self.calls: list[dict] = []  # what verl's resume loop sent: prompt + tokens so far, the budget left
        self.row_of: dict[float, tuple[list[int], list[float]]] = {}
        self.version_of: list[int] = []  # the version that generated each token, in order
        self.done = 0

    async def remote(self, *, prompt_ids, sampling_params, **kwargs):
        count, stop_reason, version = SEGMENTS[len(self.calls)]
        self.calls.append({"prompt_ids": list(prompt_ids), "max_tokens": sampling_params.get("max_tokens")})
        count = len(self.answer) - self.done if count is None else count
        token_ids = self.answer[self.done : self.done + count]
        ids, lps = np.zeros((count, K), np.int64), np.zeros((count, K), np.float32)
        for row, token in enumerate(token_ids):
            n = self.done + row + 1
            ids[row] = [token, 1000 * version + n, 1000 * version + n + 1]
            lps[row] = -n / 64 - version / 8 - np.arange(K)
            self.row_of[float(lps[row, 0])] = (ids[row].tolist(), lps[row].tolist())
            self.version_of.append(version)
        self.done += count
        extra = {"global_steps": version}
        if self.engine is not None:
            if count:  # the patched server fills the rows of a reply with tokens only
                extra[EXTRA_IDS], extra[EXTRA_LOGPROBS] = engine_shaped_rows(self.engine, token_ids, ids, lps)
        elif count or self.empty_rows:
            extra[EXTRA_IDS], extra[EXTRA_LOGPROBS] = ids, lps
        return TokenOutput(
            token_ids=token_ids, log_probs=lps[:, 0].tolist(), stop_reason=stop_reason, extra_fields=extra
        )


def engine_shaped_rows(engine, token_ids, ids, lps):
    """A reply's top-K rows as the plugin's server patch makes them from the engine's own output: vLLM's per-position
    dicts {token_id: Logprob} with `logprobs=K` (the sampled token first; here it is the top-1), SGLang's
    meta_info["output_top_logprobs"] tuples (logprob, token_id, text) with one entry more than K (the patch keeps
    K), each through the patch's extraction."""
    if engine == "vllm":
        positions = [
            {int(i): Logprob(float(lp), rank + 1, "") for rank, (i, lp) in enumerate(zip(row_ids, row_lps))}
            for row_ids, row_lps in zip(ids, lps)
        ]
        return extract_vllm_topk(positions, list(token_ids), K)
    top = [
        [(float(lp), int(i), None) for i, lp in zip(row_ids, row_lps)] + [(float(row_lps[-1]) - 1.0, 7, None)]
        for row_ids, row_lps in zip(ids, lps)
    ]
    return extract_sglang_topk(top, K)


class ResumingClient(llm_server.FullyAsyncLLMServerClient):
    """verl's real resume loop (`FullyAsyncLLMServerClient.generate`, the async trainers' client) over the base
    `LLMServerClient.generate` the plugin patches, against one stand-in server."""

    def __init__(self, config, server):
        super().__init__(config)
        self.server = server

    async def _acquire_server(self, request_id, **extra):
        return "server", self.server

    def _release_server(self, server_id, request_id=None):
        pass


@pytest.fixture
def no_resume_pause(monkeypatch):
    """verl's loop sleeps 1 s before each resume; the order of events is what matters here."""
    sleep = asyncio.sleep
    monkeypatch.setattr(llm_server.asyncio, "sleep", lambda delay, *args: sleep(0, *args))


@pytest.mark.parametrize(
    "empty_rows, engine",
    [(False, None), (True, None), (False, "vllm"), (False, "sglang")],
    ids=["empty-abort-without-rows", "empty-abort-with-0xK-rows", "vllm-shaped", "sglang-shaped"],
)
def test_resumed_response_keeps_one_row_per_token_from_the_reply_that_generated_it(empty_rows, engine, no_resume_pause):
    tokenizer = family_named("default").make_tokenizer()
    config = compose_config(response_length=64)
    server = AbortingServer(tokenizer, empty_rows, engine)
    prompt = tokenizer.encode("2 + 3?", add_special_tokens=False)

    async def scenario():
        with trajectory() as current:
            output = await ResumingClient(config, server).generate("r", prompt_ids=prompt, sampling_params={})
            return output, current.turns

    output, turns = asyncio.run(scenario())
    answer = server.answer
    # verl's loop: four server calls, each resuming from the prompt and the tokens generated so far
    assert [call["prompt_ids"] for call in server.calls] == [
        prompt,
        prompt + answer[:6],
        prompt + answer[:6],
        prompt + answer[:13],
    ]
    assert [call["max_tokens"] for call in server.calls] == [64, 58, 58, 51]
    assert output.token_ids == answer and output.stop_reason == "completed"
    assert (output.extra_fields["min_global_steps"], output.extra_fields["max_global_steps"]) == (1, 3)
    # exactly one row per generated token, in order, each the row of the reply (version) that generated it
    generated = np.concatenate([turn[0] for turn in turns])
    ids = np.concatenate([turn[1] for turn in turns])
    lps = np.concatenate([turn[2] for turn in turns])
    assert generated.tolist() == answer and ids.shape == lps.shape == (len(answer), K)
    assert ids[:, 0].tolist() == answer
    assert ids[:, 1].tolist() == [1000 * version + n + 1 for n, version in enumerate(server.version_of)]
    assert lps[:, 0].tolist() == pytest.approx(output.log_probs)
    assert server.version_of == [1] * 6 + [2] * 7 + [3] * (len(answer) - 13)
    # the abort that generated nothing adds no row
    assert sum(turn[0].size for turn in turns) == len(answer)
    assert [turn[0].size for turn in turns if turn[0].size] == [6, 7, len(answer) - 13]


def test_resumed_response_rows_reach_the_training_batch_through_the_agent_loop(no_resume_pause):
    """verl's real `SingleTurnAgentLoop` on the resuming client: `as_dict` lays each token's row where
    `rollout_log_probs` holds that token's log-prob (the three replies merged as one assistant turn)."""
    family = family_named("default")
    tokenizer = family.make_tokenizer()
    config = compose_config(response_length=64)
    server = AbortingServer(tokenizer)

    async def scenario():
        loop = SingleTurnAgentLoop(
            DictConfigWrap(config),
            ResumingClient(config, server),
            tokenizer,
            None,
            RLHFDataset,
            DictConfigWrap(config.data),
            hf_model_type=family.model_type,
        )
        with trajectory():
            output = await loop.run(sampling_params={}, raw_prompt=list(PROMPT))
            return output.as_dict()

    fields = asyncio.run(scenario())
    assert fields["responses"].tolist() == server.answer and bool(fields["response_mask"].all())
    assert_rows_follow_the_log_probs(fields, server)
    assert fields["rollout_topk_ids"][:, 1].tolist() == [1000 * v + n + 1 for n, v in enumerate(server.version_of)]


def test_separate_async_without_hybrid_replicas_starts():
    """verl 0.9.1's `PPOTrainerSeparateAsync._setup` logs with `logger.info(..., flush=True)` where
    `actor_rollout_ref.hybrid_engine=False`, which `logging` refuses (TypeError: every such run died at start). With
    the plugin loaded the module's logger takes the call, and still logs through verl's logger of that name."""
    import verl.trainer.ppo.v1.trainer_separate_async as module

    source = inspect.getsource(module.PPOTrainerSeparateAsync._setup)
    assert "flush=True" in source  # the call the patch is for (verl fixed: retire patches/trainer_separate_async.py)
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    verl_logger = logging.getLogger(module.__name__)
    verl_logger.addHandler(handler)
    try:
        module.logger.warning("hybrid replicas disabled: %d standalone replicas only", 1, flush=True)
    finally:
        verl_logger.removeHandler(handler)
    assert [r.getMessage() for r in records] == ["hybrid replicas disabled: 1 standalone replicas only"]
