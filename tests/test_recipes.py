"""Reproduction recipes: every setup x method composes on verl's ppo_trainer.yaml and passes verl's own checks, on CPU;
the published values of the paper reach the config verl will run; bad input gets an error that says what to do.
"""

from __future__ import annotations

import fnmatch
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from omegaconf import OmegaConf

from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY
from verl.utils.config import omega_conf_to_dataclass

from verl_dppo import cli
from verl_dppo.plugin.config import resolve_options
from verl_dppo.launch.compose import (
    RecipeError,
    check_paths,
    check_supported,
    compose_recipe,
    list_recipes,
    recipes_dir,
    validate_recipe,
)

RECIPES = list_recipes()
SETUPS = [info.name for info in RECIPES["setup"]]
METHODS = [info.name for info in RECIPES["method"]]
MOE = ("moe_base", "moe_base_r3", "moe_thinking", "moe_base_lora")
RECOMPUTE = ("minirl", "minirl_tis", "dppo_binary_kl_decoupled", "minimal_mask_0.5_recompute")
_cache: dict = {}


def recipe(setup: str, method: str, *overrides: str):
    key = (setup, method, overrides)
    if key not in _cache:
        _cache[key] = compose_recipe(setup, method, overrides)
    return _cache[key]


def options(config):
    """What the loss will use: the actor's dataclass as verl's workers build it, through the plugin's resolver."""
    actor = omega_conf_to_dataclass(config.actor_rollout_ref.actor)
    uses_deltas = config.actor_rollout_ref.actor.policy_loss.loss_mode != "grpo_clip"
    return actor, resolve_options(actor, uses_deltas)


def test_the_issue_lists_every_setup_and_method():
    assert set(SETUPS) == {
        "moe_base",
        "moe_base_r3",
        "moe_thinking",
        "dense_8b",
        "moe_base_lora",
        "sanity_1p5b",
        "efficiency_1p7b",
        "cpu_tiny",
        "smollm2",
    }
    assert set(METHODS) >= {
        "grpo_clip_higher",
        "cispo",
        "dppo_binary_tv",
        "dppo_binary_kl",
        "dppo_topk_tv",
        "dppo_topk_kl",
        "pg_is",
        "pg_tis",
        "minirl",
        "minirl_tis",
        "dppo_binary_kl_decoupled",
        "minimal_mask_0.5",
        "minimal_mask_0.8",
        "relax_low",
        "relax_high",
        "relax_both",
    }
    assert all(info.figure for group in ("setup", "method") for info in RECIPES[group])
    assert [info.name for info in RECIPES["trainer_mode"]] == ["sync", "colocate_async", "separate_async"]
    assert all(info.summary.startswith("verl's") for info in RECIPES["trainer_mode"])


@pytest.mark.parametrize("setup", SETUPS)
def test_every_method_composes_and_passes_verl_validation(setup):
    for method in METHODS:
        config = recipe(setup, method)
        validate_recipe(config)  # verl's validate_config + the workers' dataclass conversions
        assert (config.dppo.setup, config.dppo.method) == (setup, method)
        assert config.actor_rollout_ref.actor.policy_loss.loss_mode in POLICY_LOSS_REGISTRY


@pytest.mark.parametrize("setup", MOE)
def test_published_values_of_the_30b_a3b_script(setup):
    config = recipe(setup, "dppo_binary_tv")
    actor = config.actor_rollout_ref.actor
    assert config.data.train_batch_size == 256
    assert config.actor_rollout_ref.rollout.n == 16
    assert actor.ppo_mini_batch_size == 32 and actor.ppo_epochs == 1
    lr = 1e-5 if setup == "moe_base_lora" else 1e-6  # LoRA's lr is [NF]: 10x the published full-model lr
    assert actor.optim.lr == pytest.approx(lr) and actor.optim.lr_decay_style == "constant"
    assert (config.data.max_prompt_length, config.data.max_response_length) == (2048, 8192)
    assert config.actor_rollout_ref.rollout.response_length == 8192
    assert actor.loss_agg_mode == "seq-mean-token-sum-norm"  # Dr.GRPO
    assert config.algorithm.adv_estimator == "grpo" and config.algorithm.norm_adv_by_std_in_grpo is False
    assert actor.use_kl_loss is False and actor.entropy_coeff == 0 and actor.clip_ratio_c == 10000
    assert config.algorithm.rollout_correction.bypass_mode is True  # anchored on the rollout
    assert config.actor_rollout_ref.rollout.calculate_log_probs is True
    assert config.reward.reward_manager.name == "dapo"
    assert (config.trainer.total_training_steps, config.trainer.test_freq) == (500, 10)
    assert (actor.strategy, actor.megatron.tensor_model_parallel_size, actor.megatron.expert_model_parallel_size) == (
        "megatron",
        2,
        8,
    )
    assert config.actor_rollout_ref.rollout.tensor_model_parallel_size == 4
    assert (config.trainer.nnodes, config.trainer.n_gpus_per_node) == (2, 8)
    val = config.actor_rollout_ref.rollout.val_kwargs
    assert (val.temperature, val.top_p, val.top_k) == (1.0, 1.0, -1)


@pytest.mark.parametrize("setup", SETUPS)
def test_r3_only_in_the_r3_setup_and_lora_only_in_the_lora_setup(setup):
    config = recipe(setup, "dppo_binary_kl")
    arr = config.actor_rollout_ref
    r3 = (
        arr.rollout.enable_rollout_routing_replay
        or arr.actor.get("megatron", {}).get("router_replay", {}).get("mode", "disabled") != "disabled"
    )
    lora = arr.model.lora.rank > 0 or arr.model.lora_rank > 0
    assert r3 == (setup == "moe_base_r3")
    assert lora == (setup == "moe_base_lora")
    if r3:
        assert arr.actor.megatron.router_replay.mode == "R3" and arr.rollout.enable_rollout_routing_replay


@pytest.mark.parametrize("setup", MOE[:3])
def test_the_moe_setups_run_on_verls_fsdp_engine_too(setup):
    """Issue 52: model_engine=dp runs a 30B-A3B setup on verl's FSDP engine with engine_settings/moe_30b*_dp.yaml
    (none of the Megatron keys, which the FSDP actor's config class refuses), R3 in the FSDP engine's key for
    moe_base_r3; the default stays the authors' Megatron layout. Both pass verl's checks and the plugin's."""
    config = recipe(setup, "dppo_binary_tv", "model_engine=dp")
    validate_recipe(config)
    actor = config.actor_rollout_ref.actor
    assert (config.model_engine, actor.strategy, "megatron" in actor, "lr_decay_style" in actor.optim) == (
        "dp",
        "fsdp2",
        False,
        False,
    )
    assert (actor.fsdp_config.param_offload, actor.optim.lr_scheduler_type, actor.optim.lr) == (True, "constant", 1e-6)
    assert (
        config.actor_rollout_ref.model.use_remove_padding
        and config.actor_rollout_ref.model.enable_gradient_checkpointing
    )
    r3 = setup == "moe_base_r3"
    assert actor.fsdp_config.get("router_replay", {}).get("mode", "disabled") == ("R3" if r3 else "disabled")
    assert config.actor_rollout_ref.rollout.enable_rollout_routing_replay == r3
    megatron = recipe(setup, "dppo_binary_tv").actor_rollout_ref.actor
    assert (megatron.megatron.tensor_model_parallel_size, megatron.megatron.expert_model_parallel_size) == (2, 8)
    assert megatron.megatron.router_replay.mode == ("R3" if r3 else "disabled") and "router_replay" not in (
        megatron.get("fsdp_config") or {}
    )


def test_megatrons_lora_section_on_the_fsdp_engine_is_refused_not_trained_as_full_fine_tuning():
    """moe_base_lora's LoRA is verl's Megatron `model.lora` section; the FSDP engine reads `model.lora_rank` only."""
    from verl_dppo.plugin.run_config import RunConfigError, check_run_config

    with pytest.raises(RunConfigError, match=r"model.lora.rank=32 is verl's Megatron LoRA section.*lora_rank"):
        check_run_config(recipe("moe_base_lora", "dppo_binary_tv", "model_engine=dp"))
    check_run_config(recipe("moe_base_lora", "dppo_binary_tv"))


@pytest.mark.parametrize(
    "method, mode, delta_low, delta_high",
    [
        ("dppo_binary_tv", "dppo_binary_tv", 0.15, 0.15),
        ("dppo_binary_kl", "dppo_binary_kl", 0.05, 0.05),
        ("dppo_topk_tv", "dppo_topk_tv", 0.15, 0.15),
        ("dppo_topk_kl", "dppo_topk_kl", 0.05, 0.05),
        ("grpo_clip_higher", "grpo_clip", 0.2, 0.28),
        ("minimal_mask_0.5", "dppo_binary_tv", 0.5, 1.0),
        ("minimal_mask_0.8", "dppo_binary_tv", 0.8, 1.0),
    ],
)
def test_thresholds_the_loss_will_use(method, mode, delta_low, delta_high):
    config = recipe("moe_base", method)
    actor, resolved = options(config)
    assert actor.policy_loss.loss_mode == mode
    assert (resolved.delta_low, resolved.delta_high) == pytest.approx((delta_low, delta_high))
    assert resolved.ratio_cap == 10000 and resolved.anchor == "rollout"
    assert config.algorithm.rollout_correction.bypass_mode is True


@pytest.mark.parametrize("method", ["dppo_topk_tv", "dppo_topk_kl"])
def test_topk_methods_use_k_20_and_the_setups_fused_kernels(method):
    config = recipe("moe_base", method)
    actor, resolved = options(config)
    assert resolved.topk == 20
    assert actor.use_fused_kernels is False and config.actor_rollout_ref.model.use_fused_kernels is False
    dense = recipe("dense_8b", method)  # FSDP: fused with the LM head (issue 20)
    assert options(dense)[0].use_fused_kernels is True and dense.actor_rollout_ref.model.use_fused_kernels is True


@pytest.mark.parametrize("method", RECOMPUTE)
def test_decoupled_methods_anchor_on_the_recomputed_policy(method):
    config = recipe("sanity_1p5b", method)
    _, resolved = options(config)
    assert resolved.anchor == "recompute"
    assert config.algorithm.rollout_correction.bypass_mode is False  # verl recomputes old_log_probs


@pytest.mark.parametrize("method", sorted(set(METHODS) - set(RECOMPUTE)))
def test_every_other_method_anchors_on_the_rollout(method):
    config = recipe("sanity_1p5b", method)
    assert options(config)[1].anchor == "rollout"
    assert config.algorithm.rollout_correction.bypass_mode is True


def test_truncation_and_relaxation_options():
    assert options(recipe("moe_base", "pg_is"))[1].ratio_cap == 10000  # PG-IS: no truncation
    for method in ("cispo", "pg_tis", "minirl_tis"):
        assert options(recipe("moe_base", method))[1].ratio_cap == 2.0  # TIS: a finite cap
    assert options(recipe("moe_base", "cispo"))[0].policy_loss.loss_mode == "pg_is"
    for side in ("low", "high", "both"):
        actor, resolved = options(recipe("efficiency_1p7b", f"relax_{side}"))
        assert (actor.policy_loss.loss_mode, resolved.relax_side, resolved.relax_below) == ("grpo_clip", side, 0.1)
        assert (resolved.delta_low, resolved.delta_high) == pytest.approx((0.2, 0.28))
    alpha = options(recipe("efficiency_1p7b", "relax_both", "actor_rollout_ref.actor.policy_loss.relax_below=0.3"))
    assert alpha[1].relax_below == 0.3  # alpha is an option (Fig. 6's sweep)


def test_minimal_mask_recipe_blocks_only_large_drops_on_negative_samples():
    """Sec. 5.3 through verl's registry with the recipe's actor config: M = 0 iff A < 0 and mu - pi > 0.5."""
    actor, _ = options(recipe("sanity_1p5b", "minimal_mask_0.5"))
    loss_fn = POLICY_LOSS_REGISTRY[actor.policy_loss.loss_mode]
    mu = torch.tensor([[0.9, 0.9, 0.01, 0.9]])
    pi = torch.tensor([[0.3, 0.6, 0.99, 0.95]])  # drop 0.6 | drop 0.3 | rise 0.98 | rise 0.05
    advantages = torch.tensor([[-1.0, -1.0, 1.0, -1.0]])
    _, metrics = loss_fn(mu.log(), pi.log(), advantages, torch.ones(1, 4), "token-mean", actor)
    assert metrics["actor/pg_clipfrac"] == pytest.approx(0.25)  # only the first token is masked
    assert metrics["actor/dppo/masked_frac_neg"] == pytest.approx(1 / 3)
    assert metrics["actor/dppo/masked_frac_pos"] == 0.0


def test_paths_come_from_one_root_variable(monkeypatch, tmp_path):
    monkeypatch.setenv("DPPO_ROOT", str(tmp_path))
    config = compose_recipe("moe_base", "dppo_binary_tv")
    resolved = OmegaConf.to_container(config, resolve=True)
    assert resolved["actor_rollout_ref"]["model"]["path"] == f"{tmp_path}/models/Qwen3-30B-A3B-Base"
    assert resolved["data"]["train_files"] == f"{tmp_path}/data/dapo-math.parquet"
    assert resolved["data"]["val_files"] == [f"{tmp_path}/data/aime24.parquet", f"{tmp_path}/data/aime25.parquet"]
    assert resolved["trainer"]["default_local_dir"].startswith(str(tmp_path))


def test_bad_names_and_overrides_say_what_to_do():
    with pytest.raises(RecipeError, match="unknown setup 'moe_bsae'. Did you mean 'moe_base'.*verl-dppo recipes"):
        compose_recipe("moe_bsae", "dppo_binary_tv")
    with pytest.raises(RecipeError, match="unknown method 'dppo_tv'.*Choose one of"):
        compose_recipe("moe_base", "dppo_tv")
    with pytest.raises(
        RecipeError, match="trainer.nnode=4: verl's config has no key trainer.nnode; did you mean trainer.nnodes\\?$"
    ):  # not Hydra's "use +trainer.nnode" (issue 43.5)
        compose_recipe("moe_base", "dppo_binary_tv", ["trainer.nnode=4"])
    with pytest.raises(RecipeError, match="key=value"):
        compose_recipe("moe_base", "dppo_binary_tv", ["trainer.nnodes"])
    with pytest.raises(RecipeError, match="bypass_mode=False"):
        validate_recipe(compose_recipe("moe_base", "minirl", ["algorithm.rollout_correction.bypass_mode=true"]))
    with pytest.raises(RecipeError, match="not registered"):
        validate_recipe(compose_recipe("moe_base", "pg_is", ["actor_rollout_ref.actor.policy_loss.loss_mode=dppo"]))
    no_micro_batch = ["actor_rollout_ref.actor.use_dynamic_bsz=false"]  # verl's ActorConfig demands a micro-batch
    with pytest.raises(RecipeError, match="verl rejects the config.*ppo_micro_batch_size_per_gpu"):
        validate_recipe(compose_recipe("dense_8b", "pg_is", no_micro_batch))


def test_run_refuses_to_launch_without_its_data_and_says_how_to_get_it(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("DPPO_ROOT", str(tmp_path))
    (tmp_path / "models" / "DeepSeek-R1-Distill-Qwen-1.5B").mkdir(parents=True)
    (tmp_path / "models" / "DeepSeek-R1-Distill-Qwen-1.5B" / "config.json").write_text("{}")
    assert cli.main(["run", "sanity_1p5b", "--method", "pg_is"]) == 2
    err = capsys.readouterr().err
    assert f"verl-dppo data math-sanity --out {tmp_path}/data" in err
    assert "model.path" not in err  # the model exists; only the data is missing
    assert check_paths(compose_recipe("sanity_1p5b", "pg_is"))  # and a dry run only warns


def test_a_missing_data_file_of_the_users_own_gets_a_conversion_hint_not_a_data_set_that_does_not_exist(
    monkeypatch, tmp_path
):
    """Issue 18.10: `verl-dppo data` writes DIR/NAME.parquet for its own data sets only; for any other file name
    the old hint proposed `verl-dppo data train`, a command that fails. A file named after a data set keeps the
    one-line command; DPPO_ROOT is mentioned only for a path under it."""
    from verl_dppo.datasets import DATASETS

    monkeypatch.setenv("DPPO_ROOT", str(tmp_path / "root"))
    mine = str(tmp_path / "mine" / "train.parquet")
    config = compose_recipe("sanity_1p5b", "pg_is", [f"data.train_files={mine}"])
    (train, val) = [p for p in check_paths(config) if p.startswith("data.")]
    assert train.startswith(f"data.train_files: {mine} does not exist. Point data.train_files at a parquet file")
    assert "verl-dppo data train" not in train and "DPPO_ROOT" not in train
    assert "--from-file FILE --out DIR` converts" in train and ", ".join(sorted(DATASETS)) in train
    assert f"`verl-dppo data math-sanity --out {tmp_path}/root/data`" in val and "set DPPO_ROOT" in val


def test_run_refuses_top_k_where_the_logits_hook_cannot_run_and_a_dry_run_warns(monkeypatch, tmp_path, capsys):
    # Top-K runs on both engines (Megatron: vocabulary-parallel reduction); settings under which the actor's logits
    # hook cannot run would stop at the first actor update: `run` refuses them up front.
    assert check_supported(recipe("moe_base", "dppo_topk_tv")) == []
    assert check_supported(recipe("dense_8b", "dppo_topk_kl")) == []
    dcp = "actor_rollout_ref.actor.megatron.dynamic_context_parallel=True"
    assert "dynamic_context_parallel=False" in check_supported(recipe("moe_base", "dppo_topk_tv", dcp))[0]
    assert check_supported(recipe("moe_base", "dppo_binary_tv", dcp)) == []
    # Fused kernels (issue 20): dense_8b (FSDP) switches them on and the Top-K statistics are fused with the LM head;
    # Megatron's fused path and verl's Triton backend cannot serve them.
    fused = "actor_rollout_ref.model.use_fused_kernels=True"
    assert recipe("dense_8b", "dppo_topk_kl").actor_rollout_ref.model.use_fused_kernels is True
    assert check_supported(recipe("dense_8b", "troll")) == []
    triton = "actor_rollout_ref.model.fused_kernel_options.impl_backend=triton"
    assert "impl_backend=torch" in check_supported(recipe("dense_8b", "dppo_topk_kl", triton))[0]
    assert "use_fused_kernels=False" in check_supported(recipe("moe_base", "dppo_topk_kl", fused))[0]
    monkeypatch.setenv("DPPO_ROOT", str(tmp_path))
    assert cli.main(["run", "moe_base", "--method", "dppo_topk_kl", fused]) == 2
    assert "dppo_topk_kl with use_fused_kernels on the Megatron engine" in capsys.readouterr().err


def test_recipes_command_lists_each_recipe_with_its_figure(capsys):
    assert cli.main(["recipes"]) == 0
    out = capsys.readouterr().out
    for info in RECIPES["setup"] + RECIPES["method"]:
        assert info.name in out and info.figure in out


def test_dry_run_prints_only_the_resolved_yaml(tmp_path):
    """The real command line: exit 0, stdout is one YAML document (verl's chatter goes to stderr)."""
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "verl_dppo.cli",
            "run",
            "moe_base_r3",
            "--method",
            "dppo_binary_kl",
            "--dry-run",
            "trainer.nnodes=4",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, DPPO_ROOT=str(tmp_path)),
    )
    assert result.returncode == 0, result.stderr
    config = yaml.safe_load(result.stdout)
    assert config["trainer"]["nnodes"] == 4
    assert config["actor_rollout_ref"]["actor"]["policy_loss"]["delta_low"] == 0.05
    assert config["actor_rollout_ref"]["actor"]["megatron"]["router_replay"]["mode"] == "R3"
    assert config["actor_rollout_ref"]["model"]["path"] == f"{tmp_path}/models/Qwen3-30B-A3B-Base"
    assert "${" not in result.stdout  # fully resolved
    # verl's file logger writes under $DPPO_ROOT/logs, not in a Ray actor's working directory
    assert config["ray_kwargs"]["ray_init"]["runtime_env"]["env_vars"]["VERL_FILE_LOGGER_ROOT"] == f"{tmp_path}/logs"
    assert "verl-dppo data dapo-math" in result.stderr
    # verl's "[validate_config] All configuration checks passed" is not printed (a refusal could follow it); the dry
    # run's last line gives the verdict, counting what would stop the launch
    assert "[validate_config]" not in result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith("verl-dppo: dry run: the config passed verl's checks")


def test_every_recipe_file_ships_in_the_package(monkeypatch):
    """setup.py's packages and package_data must cover every recipe file, or `verl-dppo run` breaks in a regular
    install: read what setup() is called with, and match each file against its package's patterns."""
    import runpy

    import setuptools

    captured = {}
    monkeypatch.setattr(setuptools, "setup", lambda **kwargs: captured.update(kwargs))
    repo = Path(__file__).resolve().parent.parent
    monkeypatch.chdir(repo)
    runpy.run_path(str(repo / "setup.py"))
    packages, package_data = set(captured["packages"]), captured["package_data"]
    root = recipes_dir()
    for path in root.rglob("*"):
        if path.is_file() and path.suffix in (".yaml", ".md"):
            relative = path.relative_to(root)
            package = ".".join(["verl_dppo", "recipes", *relative.parent.parts])
            assert package in packages, f"{package} is not in setup.py's packages"
            assert any(fnmatch.fnmatch(relative.name, pattern) for pattern in package_data.get(package, [])), relative


def test_a_user_setup_and_method_from_config_dir_compose_and_dry_run(monkeypatch, tmp_path, capsys):
    """Bring your own model and data: `run --config-dir DIR` reads DIR/setup/*.yaml and DIR/method/*.yaml like the
    shipped ones; a user setup may start from a shipped one and change only the model and the data."""
    monkeypatch.setenv("DPPO_ROOT", str(tmp_path / "root"))
    user = tmp_path / "my recipes"  # a space in the path, too
    (user / "setup").mkdir(parents=True)
    (user / "method").mkdir()
    (user / "setup" / "my_model.yaml").write_text(
        "# @package _global_\n# My model on my data.\ndefaults:\n  - sanity_1p5b\n"
        "dppo:\n  setup: my_model\n  setup_figure: none\n"
        f"actor_rollout_ref:\n  model:\n    path: {tmp_path}/models/tiny\n"
        f"data:\n  train_files: {tmp_path}/data/train.parquet\n  val_files: {tmp_path}/data/val.parquet\n"
    )
    (user / "method" / "my_tv.yaml").write_text(
        "# @package _global_\ndefaults:\n  - dppo_binary_tv\ndppo:\n  method: my_tv\n"
        "actor_rollout_ref:\n  actor:\n    policy_loss:\n      delta_low: 0.1\n      delta_high: 0.1\n"
    )
    config = compose_recipe("my_model", "my_tv", ["trainer.nnodes=1"], config_dirs=[str(user)])
    validate_recipe(config)
    shipped = recipe("sanity_1p5b", "dppo_binary_tv")
    assert config.actor_rollout_ref.model.path == f"{tmp_path}/models/tiny"
    assert config.data.train_batch_size == shipped.data.train_batch_size  # the rest from the shipped setup
    assert config.actor_rollout_ref.actor.policy_loss.loss_mode == "dppo_binary_tv"
    assert config.actor_rollout_ref.actor.policy_loss.delta_low == 0.1

    assert cli.main(["run", "my_model", "--method", "my_tv", "--config-dir", str(user), "--dry-run"]) == 0
    captured = capsys.readouterr()
    dumped = yaml.safe_load(captured.out)
    assert dumped["dppo"]["setup"] == "my_model" and dumped["data"]["val_files"] == f"{tmp_path}/data/val.parquet"
    # the pre-flight checks read the user's paths: a dry run warns that they do not exist yet
    assert f"data.train_files: {tmp_path}/data/train.parquet does not exist" in captured.err
    assert f"actor_rollout_ref.model.path: {tmp_path}/models/tiny does not exist" in captured.err

    (user / "setup" / "dense_8b.yaml").write_text("# @package _global_\n")
    cases = [
        (["run", "dense_8b", "--method", "pg_is", "--config-dir", str(user), "--dry-run"], "rename your file"),
        (
            ["run", "my_model", "--method", "pg_is", "--config-dir", str(tmp_path / "nope"), "--dry-run"],
            "no such folder",
        ),
        (["run", "my_modle", "--method", "pg_is", "--dry-run"], "--config-dir DIR adds"),
    ]
    for argv, message in cases:
        assert cli.main(argv) == 2, argv
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err, (argv, err)
