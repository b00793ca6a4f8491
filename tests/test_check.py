"""`verl-dppo check` (issue 32.4): the plugin's launch checks on a plain `python -m verl.trainer.main_ppo ...` command
line, composed on verl's own config as main_ppo composes it."""

from __future__ import annotations

from pathlib import Path

import pytest
from omegaconf import OmegaConf

from test_cli_errors import FROM_GRPO, assert_one_line_error
from verl_dppo.cli import main
from verl_dppo.launch.check import EXIT_FINE, EXIT_NOT_HERE, EXIT_REHEARSAL, EXIT_WRONG


def verl_grpo_example(tmp_path) -> list[str]:
    """verl's own GRPO example command (examples/grpo_trainer/run_qwen2-7b.sh in verl's repository: Qwen2-7B on GSM8K,
    one node of 8 GPUs), its data files made here."""
    for name in ("train", "test"):
        (tmp_path / f"{name}.parquet").write_bytes(b"")
    return [
        "python3",
        "-m",
        "verl.trainer.main_ppo",
        "algorithm.adv_estimator=grpo",
        f"data.train_files={tmp_path}/train.parquet",
        f"data.val_files={tmp_path}/test.parquet",
        "data.train_batch_size=1024",
        "data.max_prompt_length=512",
        "data.max_response_length=1024",
        "data.filter_overlong_prompts=True",
        "data.truncation=error",
        "actor_rollout_ref.model.path=Qwen/Qwen2-7B-Instruct",
        "actor_rollout_ref.actor.optim.lr=1e-6",
        "actor_rollout_ref.model.use_remove_padding=True",
        "actor_rollout_ref.actor.ppo_mini_batch_size=256",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=40",
        "actor_rollout_ref.actor.use_kl_loss=True",
        "actor_rollout_ref.actor.kl_loss_coef=0.001",
        "actor_rollout_ref.actor.kl_loss_type=low_var_kl",
        "actor_rollout_ref.actor.entropy_coeff=0",
        "actor_rollout_ref.model.enable_gradient_checkpointing=True",
        "actor_rollout_ref.actor.fsdp_config.param_offload=False",
        "actor_rollout_ref.actor.fsdp_config.optimizer_offload=False",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=40",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
        "actor_rollout_ref.rollout.name=vllm",
        "actor_rollout_ref.rollout.gpu_memory_utilization=0.6",
        "actor_rollout_ref.rollout.n=5",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=40",
        "actor_rollout_ref.ref.fsdp_config.param_offload=True",
        "algorithm.use_kl_in_reward=False",
        "trainer.critic_warmup=0",
        "trainer.logger=['console','wandb']",
        "trainer.project_name=verl_grpo_example_gsm8k",
        "trainer.experiment_name=qwen2_7b_function_rm",
        "trainer.n_gpus_per_node=8",
        "trainer.nnodes=1",
        "trainer.save_freq=20",
        "trainer.test_freq=5",
        "trainer.total_epochs=15",
    ]


def test_verls_grpo_example_passes_and_its_switch_is_checked(tmp_path, capsys):
    command = verl_grpo_example(tmp_path)
    assert main(["check", *command]) == 0
    err = capsys.readouterr().err
    assert "nothing found that would stop the launch" in err and "warning" not in err, err
    # switched by the loss_mode line alone: the inherited thresholds and the recompute pass, named
    assert main(["check", *command, FROM_GRPO[0]]) == 0
    err = capsys.readouterr().err
    assert "clip_ratio_low=0.2 clip_ratio_high=0.2 clip_ratio_c=3 inherited from verl's ratio clip" in err, err
    assert "verl recomputes the old log-probs every step" in err and "bypass_mode=True" in err, err
    # switched as the README says: the paper's settings, no warning; the rule in effect, one line before the verdict
    assert main(["check", *command, *FROM_GRPO]) == 0
    err = capsys.readouterr().err
    assert "warning" not in err, err
    assert err.splitlines()[-2:] == [
        README_RULE,
        "verl-dppo: check: the command passed verl's checks and the "
        "plugin's; nothing found that would stop the launch from here",
    ], err


README_RULE = (
    "verl-dppo: check: trains dppo_binary_tv: delta 0.15/0.15, ratio cap 10000, anchored on the rollout's "
    "log-probs, bypass on (no recompute pass), K -; beside it, unlike the paper's recipe: KL loss low_var_kl "
    "x 0.001 (and a reference model), token-mean aggregation (the paper: seq-mean-token-sum-norm), "
    "advantages divided by the group's std (the paper: not)"
)
"""Issue 43.1: what `check` prints for verl's GRPO example switched by the README's lines."""


def test_the_readme_shows_the_rule_as_check_prints_it():
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    block = readme[readme.index("## From GRPO") : readme.index("## Loss modes")]
    assert README_RULE in block


def assert_problems(capsys, argv, *fragments) -> list[str]:
    """Exit 2, one line per problem (each fragment in one of them, or in a line of what is not here), then the
    verdict counting them; no traceback. Returns the problem lines."""
    assert main(argv) == 2, argv
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    problems = [line for line in err.splitlines() if line.startswith("verl-dppo: problem: ")]
    not_here = [line for line in err.splitlines() if line.startswith("verl-dppo: not here: ")]
    for fragment in fragments:
        assert any(fragment in line for line in problems + not_here), (fragment, err)
    more = f"; {len(not_here)} more only here" if not_here else ""
    assert err.splitlines()[-1] == (
        f"verl-dppo: check: the command is wrong: {len(problems)} problem(s) above, on any machine{more} (exit 2)"
    ), err
    return problems


@pytest.mark.parametrize(
    "extra, fragments",
    [
        (["actor_rollout_ref.actor.ppo_epochs=1.5"], ["ppo_epochs=1.5: expected an integer"]),
        (["actor_rollout_ref.actor.policy_loss.loss_mode=dppo_binray_tv"], ["Did you mean 'dppo_binary_tv'"]),
        (["+actor_rollout_ref.actor.policy_loss.delta_low=0.1", FROM_GRPO[0]], ["_target_=verl_dppo.DPPOLossConfig"]),
        (
            [
                "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2",
                "+actor_rollout_ref.model.override_config.attn_implementation=sdpa",
            ],
            ["attn_implementation=sdpa"],
        ),
        (
            ["actor_rollout_ref.rollout.gpu_memory_utilisation=0.6"],
            ["did you mean actor_rollout_ref.rollout.gpu_memory_utilization?"],
        ),
    ],
)
def test_each_mistake_in_a_main_ppo_command_is_one_problem_line(tmp_path, capsys, extra, fragments):
    assert len(assert_problems(capsys, ["check", *verl_grpo_example(tmp_path), *extra], *fragments)) == 1


def test_a_line_that_is_no_override_is_one_error(tmp_path, capsys):
    assert_one_line_error(capsys, ["check", *verl_grpo_example(tmp_path), "bogus"], "'bogus' is not a Hydra override")


def test_every_problem_of_a_command_is_named_in_one_run(tmp_path, capsys):
    """Issue 40.4: four mistakes (a misspelled key, two values of the wrong type, a misspelled loss mode) and a data
    file that is not there: all five named in one run, the misspelled key with the key it is nearest to (not Hydra's
    "To append to your config use +"), before verl's own validation."""
    command = [
        item.replace(f"{tmp_path}/train.parquet", f"{tmp_path}/nowhere.parquet") for item in verl_grpo_example(tmp_path)
    ]
    problems = assert_problems(
        capsys,
        [
            "check",
            *command,
            "actor_rollout_ref.rollout.gpu_memory_utilisation=0.5",
            "actor_rollout_ref.actor.ppo_epochs=1.5",
            "trainer.nnodes=two",
            "actor_rollout_ref.actor.policy_loss.loss_mode=dppo_binray_tv",
        ],
        "did you mean actor_rollout_ref.rollout.gpu_memory_utilization?",
        "ppo_epochs=1.5: expected an integer",
        "trainer.nnodes=two: expected an integer",
        "Did you mean 'dppo_binary_tv'",
        "nowhere.parquet does not exist",
    )
    assert len(problems) == 4 and not any("append" in line for line in problems), problems


def test_exit_codes_tell_a_wrong_command_from_one_that_cannot_start_here(tmp_path, capsys):
    """Issue 43.3: 2 = the command is wrong (on any machine), 3 = it is right but what it needs is not on this
    machine (verl's GRPO example on a login node without its data), 0 = nothing found."""
    right = [*verl_grpo_example(tmp_path), *FROM_GRPO]
    elsewhere = [item.replace(str(tmp_path), str(tmp_path / "nowhere")) for item in right]
    assert main(["check", *elsewhere]) == EXIT_NOT_HERE == 3
    err = capsys.readouterr().err.splitlines()
    assert [line for line in err if line.startswith("verl-dppo: not here: ")] == [
        f"verl-dppo: not here: data.{key}_files: {tmp_path}/nowhere/{name}.parquet does not exist here"
        for key, name in (("train", "train"), ("val", "test"))
    ]
    assert err[-2:] == [
        README_RULE,
        "verl-dppo: check: the command passed verl's checks and the plugin's, but cannot "
        "start here: 2 thing(s) above that it needs are not on this machine (exit 3)",
    ], err
    # wrong and not here: the command's problem decides
    assert_problems(capsys, ["check", *elsewhere, "actor_rollout_ref.actor.ppo_epochs=1.5"], "ppo_epochs=1.5")
    assert main(["check", *right]) == EXIT_FINE == 0


def test_the_rehearsal_keeps_the_commands_update_rule(tmp_path):
    """`--rehearse` trains the command's update rule on cpu_tiny: the policy loss with the thresholds the command
    would inherit (verl's PolicyLossConfig: no DPPOLossConfig value in the way), the actor's KL loss and epochs, the
    rollout's n, GRPO's advantages; cpu_tiny supplies model, data, lengths and hardware."""
    from verl_dppo.launch.check import compose_main_ppo, split_command
    from verl_dppo.launch.rehearse import rehearsal_overrides

    overrides, path, name = split_command([*verl_grpo_example(tmp_path), FROM_GRPO[0]])
    rehearsal = rehearsal_overrides(compose_main_ppo(overrides, path, name)[0])
    for expected in (
        "++actor_rollout_ref.actor.policy_loss.loss_mode=dppo_binary_tv",
        "actor_rollout_ref.actor.policy_loss.delta_low=null",
        "++actor_rollout_ref.actor.clip_ratio_c=3.0",
        "++actor_rollout_ref.actor.use_kl_loss=true",
        "++actor_rollout_ref.actor.kl_loss_type=low_var_kl",
        "++actor_rollout_ref.actor.ppo_epochs=1",
        "++actor_rollout_ref.rollout.n=5",
        "++algorithm.adv_estimator=grpo",
        "++algorithm.norm_adv_by_std_in_grpo=true",
    ):
        assert expected in rehearsal, (expected, rehearsal)
    assert not any("model.path" in item or "train_files" in item or "n_gpus" in item for item in rehearsal)
    overrides, path, name = split_command([*verl_grpo_example(tmp_path), *FROM_GRPO])
    rehearsal = rehearsal_overrides(compose_main_ppo(overrides, path, name)[0])
    assert "++actor_rollout_ref.actor.policy_loss.delta_low=0.15" in rehearsal
    assert not any(item.endswith("delta_low=null") for item in rehearsal)


def test_the_rehearsal_keeps_the_commands_shape_and_names_what_it_leaves_out(tmp_path):
    """73.4: a Qwen3-MoE + R3 + vLLM + FSDP2 command is rehearsed on cpu_tiny's MoE with the plugin's R3, on vLLM's
    CPU build where it is installed; a Megatron R3 command on verl's Megatron engine (megatron-core installed here);
    a VeOmni one's R3 on the plugin's FSDP replay; LoRA, bf16 and the trainer mode kept; the line names what is
    left out (the model, the GPUs, the parallelism, an engine the CPU lacks)."""
    from verl_dppo.launch.rehearse import rehearsal_shape
    from verl_dppo.rehearsal.setups.vllm_cpu import cpu_build_version

    command = [item.replace("Qwen/Qwen2-7B-Instruct", "Qwen/Qwen3-30B-A3B") for item in verl_grpo_example(tmp_path)]
    r3 = [
        "actor_rollout_ref.actor.strategy=fsdp2",
        "+actor_rollout_ref.actor.fsdp_config.router_replay.mode=R3",
        "actor_rollout_ref.rollout.enable_rollout_routing_replay=true",
        "actor_rollout_ref.model.lora_rank=8",
        "+actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype=bf16",
        "trainer.nnodes=4",
    ]
    shape = rehearsal_shape(_verdict([*command, *FROM_GRPO, *r3]).config)
    vllm = ["actor_rollout_ref.rollout.name=vllm"] if cpu_build_version() else []
    assert shape.overrides == [
        *vllm,
        "dppo.tiny_model.num_experts=4",
        "+actor_rollout_ref.actor.fsdp_config.router_replay.mode=R3",
        "actor_rollout_ref.rollout.enable_rollout_routing_replay=true",
        "actor_rollout_ref.model.lora_rank=8",
        "actor_rollout_ref.model.lora_alpha=16",
        "actor_rollout_ref.model.target_modules=all-linear",
        "actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype=bf16",
        *([] if vllm else ["actor_rollout_ref.rollout.dtype=bfloat16"]),
    ], shape.overrides
    line = " ".join(shape.lines("dppo_binary_tv", 2))
    for part in (
        "a MoE (cpu_tiny's, 4 experts top-2",
        "router replay R3 (the plugin's, FSDP)",
        "LoRA rank 8",
        "bf16 (the actor",
        "the KL term and its reference",
        "FSDP2",
        "left out: the model Qwen/Qwen3-30B-A3B",
        "4 node(s) x 8 GPU(s)",
        "the rollout's tensor parallelism 2",
    ):
        assert part in line, (part, line)
    assert ("vLLM (its CPU build)" in line) == bool(vllm), line
    megatron = _megatron_example(tmp_path)
    shape = rehearsal_shape(
        _verdict(
            [
                *megatron[:3],
                "--config-name=ppo_megatron_trainer",
                *megatron[3:],
                *FROM_GRPO,
                "actor_rollout_ref.actor.megatron.router_replay.mode=R3",
                "actor_rollout_ref.rollout.enable_rollout_routing_replay=true",
                "trainer.v1.trainer_mode=colocate_async",
            ]
        ).config
    )
    if vllm:
        assert shape.overrides == [
            *vllm,
            "model_engine=megatron",
            "dppo.tiny_model.num_experts=4",
            "actor_rollout_ref.actor.megatron.router_replay.mode=R3",
            "actor_rollout_ref.rollout.enable_rollout_routing_replay=true",
        ], shape.overrides
    assert shape.trainer_mode == "colocate_async" and "the colocate_async trainer" in shape.kept, shape
    shape = rehearsal_shape(
        _verdict(
            [
                *megatron[:3],
                "model_engine=veomni",
                *megatron[3:],
                *FROM_GRPO,
                "actor_rollout_ref.actor.veomni.router_replay.mode=R3",
                "actor_rollout_ref.rollout.enable_rollout_routing_replay=true",
            ]
        ).config
    )
    assert "+actor_rollout_ref.actor.fsdp_config.router_replay.mode=R3" in shape.overrides, shape.overrides
    assert "the VeOmni engine (it does not run on the CPU: FSDP2 instead)" in shape.left_out, shape.left_out
    assert any("for the veomni engine's" in item for item in shape.kept), shape.kept


def verl_lora_example(tmp_path) -> list[str]:
    """verl's own GRPO example on GSM8K with LoRA's settings (examples/grpo_trainer/run_qwen2_5-3b_gsm8k_grpo_lora.sh
    in verl's repository, its arguments as of commit 0061a22: Qwen2.5-3B-Instruct, one node of 8 GPUs), its data files
    made here."""
    for name in ("train", "test"):
        (tmp_path / f"{name}.parquet").write_bytes(b"")
    return [
        "python3",
        "-m",
        "verl.trainer.main_ppo",
        "algorithm.adv_estimator=grpo",
        f"data.train_files={tmp_path}/train.parquet",
        f"data.val_files={tmp_path}/test.parquet",
        "data.train_batch_size=1024",
        "data.max_prompt_length=512",
        "data.max_response_length=1024",
        "data.filter_overlong_prompts=True",
        "data.truncation='error'",
        "data.prompt_key=messages",
        "data.shuffle=False",
        "actor_rollout_ref.model.path=Qwen/Qwen2.5-3B-Instruct",
        "actor_rollout_ref.model.use_shm=True",
        "actor_rollout_ref.actor.optim.lr=3e-6",
        "actor_rollout_ref.model.use_remove_padding=True",
        "actor_rollout_ref.actor.ppo_mini_batch_size=256",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=40",
        "actor_rollout_ref.actor.use_kl_loss=True",
        "actor_rollout_ref.actor.kl_loss_coef=0.001",
        "actor_rollout_ref.actor.kl_loss_type=low_var_kl",
        "actor_rollout_ref.actor.entropy_coeff=0",
        "actor_rollout_ref.model.enable_gradient_checkpointing=True",
        "actor_rollout_ref.actor.fsdp_config.param_offload=False",
        "actor_rollout_ref.actor.fsdp_config.optimizer_offload=False",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=40",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
        "actor_rollout_ref.rollout.name=vllm",
        "actor_rollout_ref.rollout.gpu_memory_utilization=0.6",
        "actor_rollout_ref.rollout.n=5",
        "actor_rollout_ref.rollout.load_format=safetensors",
        "actor_rollout_ref.rollout.layered_summon=True",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=40",
        "actor_rollout_ref.ref.fsdp_config.param_offload=True",
        "algorithm.use_kl_in_reward=False",
        "trainer.critic_warmup=0",
        "trainer.logger=['console','wandb']",
        "trainer.project_name='verl_grpo_example_gsm8k'",
        "trainer.experiment_name='qwen2_7b_function_rm'",
        "trainer.n_gpus_per_node=8",
        "trainer.nnodes=1",
        "trainer.save_freq=20",
        "trainer.test_freq=5",
        "trainer.total_epochs=15",
        "$@",
    ]


PL = "actor_rollout_ref.actor.policy_loss."
KL_LINES = [f"{PL}loss_mode=dppo_binary_kl", *[line.replace("0.15", "0.05") for line in FROM_GRPO[1:]]]
"""The README's lines for DPPO-Binary-KL: its delta 0.05."""


@pytest.mark.parametrize(
    "extra, rule",
    [
        (
            KL_LINES,
            "dppo_binary_kl: delta 0.05/0.05, ratio cap 10000, anchored on the rollout's log-probs, bypass on (no "
            "recompute pass), K -",
        ),
        (
            [*FROM_GRPO, f"{PL}loss_mode=dppo_topk_tv"],
            "dppo_topk_tv: delta 0.15/0.15, ratio cap 10000, anchored on the rollout's log-probs, bypass on (no recompute "
            "pass), K 20",
        ),
        (
            [*FROM_GRPO, f"{PL}loss_mode=troll", f"+{PL}troll_eps=0.1"],
            "troll: eps 0.1, K 64, support mass 0.99999, alpha 1, anchored on the rollout's log-probs, bypass on (no "
            "recompute pass)",
        ),
        (
            [*FROM_GRPO[1:], f"{PL}loss_mode=grpo_clip", "actor_rollout_ref.actor.clip_ratio_high=0.28"],
            "grpo_clip: ratio clip eps 0.2/0.28 (clip_ratio_low/high), ratio cap 10000, anchored on the rollout's "
            "log-probs, bypass on (no recompute pass), K -",
        ),
        # the loss_mode line alone, no bypass mode: every inherited value and the paper's beside it
        (
            [f"{PL}loss_mode=dppo_binary_tv"],
            "dppo_binary_tv: delta 0.2/0.2 (inherited from clip_ratio_low/clip_ratio_high; the paper's 0.15), ratio cap 3 "
            "(inherited from clip_ratio_c; the paper's 10000), anchored on the rollout's log-probs, bypass off (verl "
            "recomputes the old log-probs every step), K -",
        ),
        (
            [*FROM_GRPO, f"+{PL}anchor=recompute", "algorithm.rollout_correction.bypass_mode=False"],
            "dppo_binary_tv: delta 0.15/0.15, ratio cap 10000, anchored on the recomputed old log-probs (anchor=recompute), "
            "bypass off (verl recomputes the old log-probs every step), K -",
        ),
        (
            ["algorithm.rollout_correction.bypass_mode=True"],
            "vanilla, verl's own policy loss (not the plugin's): clip_ratio_low/high 0.2/0.2, clip_ratio_c 3, old "
            "log-probs from the rollout (bypass on, no recompute pass)",
        ),
    ],
)
def test_the_rule_in_effect_is_the_workers(tmp_path, extra, rule):
    """Issue 43.1: verl's LoRA example switched to each mode: the one line of what trains, and its values those the
    loss resolves at its first call from the worker's own config object (verl's ActorConfig, built by verl's
    omega_conf_to_dataclass as the worker builds it), not from the YAML."""
    from verl.utils.config import omega_conf_to_dataclass

    from verl_dppo.launch.check import check_command
    from verl_dppo.plugin.losses import LOSS_MODES

    verdict = check_command([*verl_lora_example(tmp_path), *extra])
    assert (verdict.problems, verdict.not_here, verdict.rule.split("; beside it")[0]) == ([], [], f"trains {rule}")
    actor = omega_conf_to_dataclass(verdict.config.actor_rollout_ref.actor)
    mode = next((mode for mode in LOSS_MODES if mode.name == actor.policy_loss.loss_mode), None)
    if mode is None:  # verl's own loss: its clip keys as verl reads them
        assert f"{actor.clip_ratio_low:g}/{actor.clip_ratio_high:g}, clip_ratio_c {actor.clip_ratio_c:g}" in rule
        return
    options, troll, _ = mode.family.options(mode, actor)
    if troll is not None:
        assert f"eps {troll.eps:g}, K {troll.topk}, support mass {troll.support_mass:.10g}" in rule
    else:
        assert f" {options.delta_low:g}/{options.delta_high:g}" in rule and f"ratio cap {options.ratio_cap:g}" in rule
        assert f"anchored on the {'recomputed' if options.anchor == 'recompute' else 'rollout'}" in rule


def test_costly_settings_are_named(tmp_path, capsys):
    """Issue 43.2 on verl's LoRA example: GSPO's thresholds (verl's examples/gspo_trainer/test_gspo_3b_math.sh:
    clip_ratio_low=0.0003 clip_ratio_high=0.0004) inherited by a DPPO mode are a problem that states the paper's
    value; a KL mode given the TV lines' 0.15 and a missing bypass mode are warnings, the rule still printed."""
    command = verl_lora_example(tmp_path)
    gspo = ["actor_rollout_ref.actor.clip_ratio_low=0.0003", "actor_rollout_ref.actor.clip_ratio_high=0.0004"]
    (problem,) = assert_problems(capsys, ["check", *command, *gspo, f"{PL}loss_mode=dppo_binary_tv"])
    assert (
        "dppo_binary_tv: delta_low=0.0003 (actor.clip_ratio_low) delta_high=0.0004 (actor.clip_ratio_high) "
        "inherited from verl's ratio clip, outside the TV thresholds the paper and the recipes use (0.15 to 1, "
        "DPPO's 0.15): a threshold that small blocks nearly every update"
    ) in problem, problem
    assert "+actor_rollout_ref.actor.policy_loss.delta_low=0.15" in problem
    # set for the mode, the same GSPO command trains DPPO as the paper does
    assert main(["check", *command, *gspo, *FROM_GRPO]) == 0
    assert "warning" not in capsys.readouterr().err
    kl_with_tv_delta = [*FROM_GRPO[1:-2], f"{PL}loss_mode=dppo_binary_kl"]  # no bypass_mode=True either
    assert main(["check", *command, *kl_with_tv_delta]) == 0
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("verl-dppo: warning: ")]
    assert len(warnings) == 2, warnings
    assert (
        "dppo_binary_kl: delta_low=0.15 delta_high=0.15: a TV-sized threshold (DPPO-TV's 0.15, the README's TV "
        "lines), outside the KL thresholds the paper and the recipes use (0.05): set delta_low and delta_high to "
        "the paper's KL value 0.05"
    ) in warnings[0]
    assert "verl recomputes the old log-probs every step" in warnings[1] and warnings[1].endswith(
        "set algorithm.rollout_correction.bypass_mode=True"
    )


class Calls(list):
    """The rehearsals `run` was asked for, and the exit each returns."""

    exit_code = 0


def test_the_rehearsal_says_what_it_rehearses_and_its_exit_reflects_both(tmp_path, capsys, monkeypatch):
    """Issues 43.3 and 43.4: `check --rehearse` leads with the mode it rehearses in a short line (the `run` line, some
    2,000 characters, goes to the run record); a wrong command is not rehearsed (exit 2); a right one that cannot start
    here is rehearsed and exits 3; a rehearsal that fails exits 4."""
    from verl_dppo.launch import commands as launch

    calls = Calls()

    def cmd_run(args):
        calls.append(args)
        return calls.exit_code

    monkeypatch.setattr(launch, "cmd_run", cmd_run)
    command = [*verl_lora_example(tmp_path), f"{PL}loss_mode=dppo_binary_tv"]
    assert main(["check", "--rehearse", *command, "trainer.nnodes=two"]) == EXIT_WRONG
    assert calls == [] and capsys.readouterr().err.splitlines()[-1] == (
        "verl-dppo: check: not rehearsed: the command's problems above come first"
    )
    elsewhere = [item.replace(str(tmp_path), str(tmp_path / "nowhere")) for item in command]
    assert main(["check", "--rehearse", *elsewhere]) == EXIT_NOT_HERE
    (args,) = calls
    lines = capsys.readouterr().err.splitlines()
    (lead,) = [line for line in lines if "rehearsing" in line]
    assert lead.startswith("verl-dppo: check: rehearsing dppo_binary_tv as your command sets it") and len(lead) < 300
    (left,) = [line for line in lines if "rehearsal: left out: " in line]
    assert "the model Qwen/Qwen2.5-3B-Instruct" in left and "1 node(s) x 8 GPU(s)" in left, left
    assert not any("verl-dppo run cpu_tiny" in line for line in lines)
    recorded = launch._command_line(args)  # what `run` writes into the run record
    assert recorded.startswith("verl-dppo run cpu_tiny --method grpo_clip_higher ") and len(recorded) > 1000
    assert "++actor_rollout_ref.actor.policy_loss.loss_mode=dppo_binary_tv" in recorded
    calls.exit_code = 1
    assert main(["check", "--rehearse", *elsewhere]) == EXIT_REHEARSAL
    assert capsys.readouterr().err.splitlines()[-1] == (
        "verl-dppo: check: the rehearsal of dppo_binary_tv did not train (exit 1 above)"
    )


# The rehearsal through verl's trainer on this CPU (exit 0, the command's values in effect, its KL loss logged): the
# launch after a killed one in tests/e2e/test_launcher_kill.py (`test_the_next_launch_rehearses_verls_grpo_example`).


# Issue 51: the scripts verl users actually run (the shapes of verl's examples/**/*.sh near 0.9.1), switched by the
# README's lines.


def _verdict(argv):
    from verl_dppo.launch.check import check_command

    return check_command(argv)


@pytest.mark.parametrize(
    "launcher",
    [
        [
            "uv",
            "run",
            "--frozen",
            "--all-packages",
            "--extra",
            "vllm",
            "--extra",
            "fsdp",
            "python3",
            "-m",
            "verl.trainer.main_ppo",
        ],
        ["PYTHONUNBUFFERED=1", "HYDRA_FULL_ERROR=1", "python3", "-m", "verl.trainer.main_ppo"],
        ["torchrun", "--nproc_per_node=8", "verl/trainer/main_ppo.py"],
        ["ray", "job", "submit", "--address=http://127.0.0.1:8265", "--", "python3", "-m", "verl.trainer.main_ppo"],
        ["HYDRA_FULL_ERROR=1"],
    ],
)
def test_launch_lines_as_users_type_them(tmp_path, launcher):
    """51.6: the words before main_ppo are the launcher's, whatever launches it (verl's 0.9-era scripts: uv run)."""
    command = verl_grpo_example(tmp_path)[3:]  # the overrides, behind each launcher
    verdict = _verdict([*launcher, *command, *FROM_GRPO])
    assert (verdict.problems, verdict.not_here, verdict.exit_code) == ([], [], EXIT_FINE), verdict.problems
    assert verdict.rule == README_RULE.removeprefix("verl-dppo: check: ")


@pytest.mark.parametrize(
    "entry, fragment",
    [
        ("verl.experimental.fully_async_policy.fully_async_main", "another entry point than verl.trainer.main_ppo"),
        ("verl.trainer.main_generation_server_nope", "has no such module"),
    ],
)
def test_another_entry_point_is_one_line(tmp_path, capsys, entry, fragment):
    command = ["python3", "-m", entry, *verl_grpo_example(tmp_path)[3:]]
    assert_one_line_error(capsys, ["check", *command], fragment)


def _megatron_example(tmp_path) -> list[str]:
    """verl's GRPO example as its Megatron scripts write it (no fsdp_config keys)."""
    return [item for item in verl_grpo_example(tmp_path) if ".fsdp_config." not in item]


@pytest.mark.parametrize("path", ["config", "./config", "../trainer/config"])
def test_a_relative_config_path_is_read_from_main_ppos_folder(tmp_path, monkeypatch, path):
    """51.1: verl's Megatron scripts pass --config-path=config: Hydra reads it from verl/trainer/, not the working
    folder (here a folder with no config in it), and the Megatron config is what gets checked."""
    monkeypatch.chdir(tmp_path)
    command = _megatron_example(tmp_path)
    verdict = _verdict(
        [*command[:3], f"--config-path={path}", "--config-name", "ppo_megatron_trainer", *command[3:], *FROM_GRPO]
    )
    assert verdict.problems == [] and verdict.config.actor_rollout_ref.actor.strategy == "megatron", verdict.problems


def test_router_replay_r2_with_bypass_and_more_of_verls_complaints_in_one_run(tmp_path):
    """51.2 and 51.8: verl refuses R2 with bypass mode; the plugin's line says what to do with a DPPO switch, and
    verl's batch-size complaint before it does not hide it."""
    command = _megatron_example(tmp_path)
    verdict = _verdict(
        [
            *command[:3],
            "--config-path=config",
            "--config-name=ppo_megatron_trainer",
            *command[3:],
            *FROM_GRPO,
            "actor_rollout_ref.actor.megatron.router_replay.mode=R2",
            "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=3",
        ]
    )
    assert len(verdict.problems) == 2, verdict.problems
    assert "must be divisible by model_parallel_size (3)" in verdict.problems[0]
    assert "router_replay.mode='R2' requires" in verdict.problems[1]
    assert "leave out bypass_mode=True" in verdict.problems[1], verdict.problems[1]
    # 73.5: R3's key is the one the command's engine reads (a VeOmni script is not sent to the Megatron engine)
    assert "(actor_rollout_ref.actor.megatron.router_replay.mode=R3 and" in verdict.problems[1]
    assert "verl's Megatron engine" in verdict.problems[1], verdict.problems[1]
    verdict = _verdict(
        [
            *command[:3],
            "model_engine=veomni",
            *command[3:],
            *FROM_GRPO,
            "actor_rollout_ref.actor.veomni.router_replay.mode=R2",
        ]
    )
    r2 = [problem for problem in verdict.problems if "router_replay.mode='R2' requires" in problem]
    assert r2 and "(actor_rollout_ref.actor.veomni.router_replay.mode=R3 and" in r2[0], verdict.problems
    assert "verl's VeOmni engine" in r2[0] and "Megatron" not in r2[0], r2[0]


def test_each_hint_names_the_line_that_works(tmp_path, capsys):
    """73.5, each from the line of the audit that showed it: a top-level group under a section, a plugin key without
    `+` (R3's, a DPPO option's: not "did you mean dro_beta?"), a number left empty by an unset shell variable, a
    sweep, SAPO's `tau_pos` under the policy loss, an unregistered mode (not "verl's own"), a whole command in one
    quoted word, a script's path."""
    command = [*verl_grpo_example(tmp_path), *FROM_GRPO]

    def problems(*extra):
        verdict = _verdict([*command, *extra])
        return verdict.problems, verdict.warnings

    found, _ = problems("actor_rollout_ref.actor.model_engine=megatron")
    assert len(found) == 1 and found[0].endswith("not a key of actor_rollout_ref.actor: write model_engine=megatron")
    r3 = "actor_rollout_ref.actor.fsdp_config.router_replay.mode=R3"
    found, warned = problems(r3, "actor_rollout_ref.rollout.enable_rollout_routing_replay=true")
    assert found == [
        f"{r3}: the plugin's key, which verl's config does not have, so Hydra adds it only with +: write +{r3}"
    ] and not any("did you mean" in line for line in found + warned), (found, warned)
    found, _ = problems("actor_rollout_ref.actor.policy_loss.ratio_cap=100")
    assert len(found) == 1 and "write +actor_rollout_ref.actor.policy_loss.ratio_cap=100" in found[0], found
    found, _ = problems("trainer.n_gpus_per_node=")
    assert len(found) == 1 and "leaves trainer.n_gpus_per_node= empty" in found[0], found
    # a key of an older verl in another of verl's classes (sglang_multiturn's geo3k config): its nearest fields
    found, _ = problems("+actor_rollout_ref.rollout.multi_turn.max_turns=5")
    assert len(found) == 1 and found[0].endswith(
        "MultiTurnConfig has no field max_turns (did you mean max_user_turns or max_assistant_turns?): a key of "
        "another verl version?"
    ), found
    found, _ = problems("trainer.n_gpus_per_node=", "trainer.nnodes=")  # '' * '': a script's unset GPUS and NODES
    assert len(found) == 1 and "leaves trainer.n_gpus_per_node=, trainer.nnodes= empty" in found[0], found
    # a path verl opens at launch, left empty: Hydra and verl's classes take '', the launch fails at the load
    found, _ = problems("actor_rollout_ref.model.path=", "data.train_files=")
    assert [line.split(" is empty", 1)[0] for line in found] == ["actor_rollout_ref.model.path", "data.train_files"]
    assert "a shell variable the script left unset" in found[0], found
    found, _ = problems(f"data.val_files=[{tmp_path}/test.parquet,'']")
    assert len(found) == 1 and found[0].startswith("data.val_files is empty"), found
    found, _ = problems("actor_rollout_ref.actor.optim.lr=1e-6,2e-6")
    assert len(found) == 1 and "--multirun" in found[0] and "ChoiceSweep" not in found[0], found
    found, _ = problems(
        "actor_rollout_ref.actor.policy_loss.loss_mode=sapo", "+actor_rollout_ref.actor.policy_loss.tau_pos=1.0"
    )
    assert len(found) == 1 and "verl reads tau_pos at actor_rollout_ref.actor.tau_pos" in found[0], found
    found, warned = problems("actor_rollout_ref.actor.policy_loss.loss_mode=dppo_binary_tw")
    assert len(found) == 1 and "not registered" in found[0] and not any("verl's own" in w for w in warned), warned
    verdict = _verdict([" ".join(command)])
    assert verdict.problems == [] and verdict.config.actor_rollout_ref.actor.policy_loss.delta_low == 0.15
    assert_one_line_error(
        capsys, ["check", "examples/grpo_trainer/run_qwen3_8b.sh"], "a shell script", "pass that line's words"
    )


def test_a_config_package_that_is_not_installed_is_one_not_here_line(tmp_path):
    """51.4: a script that adds a config package to Hydra's search path: one line naming it (exit 3), not a problem
    for each key it would define."""
    verdict = _verdict(
        [
            *verl_grpo_example(tmp_path),
            "hydra.searchpath=[pkg://verl_dppo_no_such_pkg.config]",
            "actor_rollout_ref.actor.no_such_key=1",
            *FROM_GRPO,
        ]
    )
    assert verdict.problems == [] and verdict.exit_code == EXIT_NOT_HERE, verdict.problems
    assert len(verdict.not_here) == 1 and "'verl_dppo_no_such_pkg' is not installed here" in verdict.not_here[0]


def test_a_primary_configs_own_search_path_is_looked_up_where_the_command_runs(tmp_path, monkeypatch):
    """verl's multi-turn scripts (examples/sglang_multiturn/): `--config-path` to a folder whose config adds
    `file://verl/trainer/config` to Hydra's search path, relative to verl's checkout root, where they run. Run from
    elsewhere: one not-here line naming that entry and the folder (exit 3), not Hydra's "Could not load
    'ppo_trainer'" as a problem (exit 2); from a folder that has it (verl's installed package stands in for the
    checkout's verl/): the command composes, the primary config's own keys in it."""
    import verl

    config = tmp_path / "examples" / "config"
    config.mkdir(parents=True)
    (config / "multiturn_grpo.yaml").write_text(
        "hydra:\n  searchpath:\n    - file://verl/trainer/config\n"
        "defaults:\n  - ppo_trainer\n  - _self_\ndata:\n  return_raw_chat: true\n"
    )
    command = verl_grpo_example(tmp_path)
    argv = [*command[:3], f"--config-path={config}", "--config-name=multiturn_grpo", *command[3:], *FROM_GRPO]
    monkeypatch.chdir(tmp_path)
    verdict = _verdict(argv)
    assert verdict.problems == [] and verdict.exit_code == EXIT_NOT_HERE, verdict.problems
    assert len(verdict.not_here) == 1, verdict.not_here
    assert f"file://verl/trainer/config: no such folder here (from {tmp_path}:" in verdict.not_here[0]
    (tmp_path / "verl").symlink_to(Path(verl.__file__).parent)
    verdict = _verdict(argv)
    assert verdict.problems == [] and verdict.config.data.return_raw_chat is True, verdict.problems


def test_a_critic_model_that_is_not_here_is_named_without_retries(tmp_path):
    """51.4: a GAE script's critic: verl's check reads its config.json from the hub; `check` downloads nothing, names
    it once (exit 3) in seconds, and checks everything else."""
    import time

    start = time.monotonic()
    verdict = _verdict(
        [
            *verl_grpo_example(tmp_path),
            *FROM_GRPO,
            "algorithm.adv_estimator=gae",
            "critic.model.path=verl-dppo-tests/no-such-critic",
            "critic.ppo_micro_batch_size_per_gpu=8",
        ]
    )
    assert time.monotonic() - start < 15
    assert verdict.problems == [] and verdict.exit_code == EXIT_NOT_HERE, verdict.problems
    assert (
        len(verdict.not_here) == 1 and "verl-dppo-tests/no-such-critic is neither a local folder" in verdict.not_here[0]
    )
    assert "gae advantages (the paper: grpo)" in verdict.rule


@pytest.mark.parametrize(
    "override, expected",
    [
        ("algorithm.rollout_correction.rollout_is_threshold=0.5_4.0", None),  # str | float in verl's dataclass
        ("algorithm.rollout_correction.rollout_rs_threshold=0.5_2.0", None),
        ("algorithm.rollout_correction.bypass_mode=maybe", "expected a boolean (true/false) like verl's value False"),
        ("actor_rollout_ref.actor.entropy_coeff=0.01", None),  # a float in verl's ActorConfig, 0 in its YAML
    ],
)
def test_types_come_from_verls_config_classes(tmp_path, override, expected):
    """51.5: a value verl accepts is no problem; one it refuses is, said against verl's value (no recipe here)."""
    verdict = _verdict([*verl_grpo_example(tmp_path), *FROM_GRPO, override])
    found = [problem for problem in verdict.problems if override.split("=")[0] in problem]
    assert (found[0] if found else None) == (expected and f"{override}: {expected}, got str 'maybe'"), verdict.problems


def test_distillation_without_task_rewards_is_a_problem(tmp_path):
    """51.3: verl's distillation_ppo_loss multiplies the policy loss by zero without task rewards."""
    command = [*verl_grpo_example(tmp_path), *FROM_GRPO, "distillation.enabled=True"]
    verdict = _verdict([*command, "distillation.distillation_loss.use_task_rewards=False"])
    assert (
        len(verdict.problems) == 1 and "multiplies the policy loss (dppo_binary_tv) by zero" in verdict.problems[0]
    ), verdict.problems
    verdict = _verdict([*command, "distillation.distillation_loss.use_task_rewards=True"])
    assert verdict.problems == [] and "plus the distillation loss k3 x 1" in verdict.rule, verdict.problems


PAPER_LINES = [
    "actor_rollout_ref.actor.use_kl_loss=False",
    "actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-sum-norm",
    "actor_rollout_ref.actor.loss_scale_factor=1024",
    "algorithm.norm_adv_by_std_in_grpo=False",
]
"""The README's lines for the paper's whole update, on verl's GRPO example (max_response_length 1024)."""


def test_the_summary_names_the_rest_of_the_update(tmp_path, capsys):
    """51.7: with the README's paper lines the rule has nothing beside the trust region; a dropped rejection sampling
    and the plugin's thresholds under verl's own loss mode are warnings."""
    command = [*verl_grpo_example(tmp_path), *FROM_GRPO]
    verdict = _verdict([*command, *PAPER_LINES])
    assert verdict.problems == [] and verdict.rule == README_RULE.split("; beside it")[0].removeprefix(
        "verl-dppo: check: "
    ), verdict.rule
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    assert all(line.split("=")[0] in readme for line in PAPER_LINES)
    verdict = _verdict(
        [*command, "algorithm.rollout_correction.rollout_rs=token_k1", "actor_rollout_ref.actor.entropy_coeff=0.001"]
    )
    assert any("rollout_rs=token_k1: bypass_mode=True makes verl's trainer skip" in w for w in verdict.warnings)
    assert "entropy bonus 0.001" in verdict.rule and "rollout_rs=token_k1 dropped" in verdict.rule
    verdict = _verdict([*command[: len(command) - len(FROM_GRPO)], *FROM_GRPO[1:]])
    assert any("loss_mode=vanilla is verl's own and does not read them" in w for w in verdict.warnings), (
        verdict.warnings
    )


def test_router_replay_on_verls_fsdp_engine_where_it_can_act_and_where_not(tmp_path):
    """Issue 52: R3 on verl's FSDP engine is the plugin's (vLLM returns the routes, the trainer's routers replay
    them); where it cannot act it is refused in one line, rather than train on the trainer's own routes without a
    word, under verl's own loss as under a plugin mode (issue 73.2: the plugin's patch acts whatever the loss mode,
    and stopped the run at its first micro-batch where `check` had warned); routes returned and read by nothing are a
    warning."""
    r3, returned = (
        "+actor_rollout_ref.actor.fsdp_config.router_replay.mode=R3",
        "actor_rollout_ref.rollout.enable_rollout_routing_replay=true",
    )
    command = [*verl_grpo_example(tmp_path), *FROM_GRPO]
    verdict = _verdict([*command, r3, returned])
    assert verdict.problems == [], verdict.problems
    for extra, fragment in (
        ([r3], "returns only with actor_rollout_ref.rollout.enable_rollout_routing_replay=True"),
        ([r3.replace("R3", "R2"), returned], "the FSDP engine replays R3 only"),
        (
            [r3, returned, "actor_rollout_ref.model.use_remove_padding=False"],
            "set actor_rollout_ref.model.use_remove_padding=True",
        ),
    ):
        verdict = _verdict([*command, *extra])
        assert len(verdict.problems) == 1 and fragment in verdict.problems[0], (extra, verdict.problems)
    for extra, fragment in (
        ([r3], "returns only with actor_rollout_ref.rollout.enable_rollout_routing_replay=True"),
        (
            [r3, returned, "actor_rollout_ref.model.use_remove_padding=False"],
            "set actor_rollout_ref.model.use_remove_padding=True",
        ),
    ):
        verdict = _verdict([*verl_grpo_example(tmp_path), *extra])  # verl's own loss (vanilla): refused too
        assert len(verdict.problems) == 1 and fragment in verdict.problems[0], (extra, verdict.problems)
    verdict = _verdict([*verl_grpo_example(tmp_path), returned])
    assert verdict.problems == [] and any("nothing replays them" in warning for warning in verdict.warnings)
    megatron = _megatron_example(tmp_path)
    verdict = _verdict(
        [
            *megatron[:3],
            "--config-name=ppo_megatron_trainer",
            *megatron[3:],
            *FROM_GRPO,
            "actor_rollout_ref.actor.megatron.router_replay.mode=R3",
            returned,
        ]
    )
    assert not any("replay" in line for line in verdict.problems + verdict.warnings), verdict.problems


@pytest.mark.parametrize("engine", ["dp", "megatron"])
def test_a_dry_runs_yaml_alone_is_checked_as_main_ppo_runs_it_and_agrees(tmp_path, engine):
    """Issue 52: `verl-dppo run moe_base_r3 ... --dry-run > run.yaml` on either engine, then the README's own line
    `python3 -m verl.trainer.main_ppo --config-path=$PWD --config-name=run` (no override at all) through `check`:
    the same verdict as the dry run (no problem; the model and data are only not here)."""
    from verl_dppo.launch.compose import compose_recipe

    config = compose_recipe("moe_base_r3", "dppo_binary_tv", [f"model_engine={engine}"])
    (tmp_path / "run.yaml").write_text(OmegaConf.to_yaml(config))
    verdict = _verdict(["python3", "-m", "verl.trainer.main_ppo", f"--config-path={tmp_path}", "--config-name=run"])
    assert verdict.problems == [] and verdict.config.model_engine == engine, verdict.problems
    assert verdict.not_here, "the 30B model and the data are not on this machine"
    assert verdict.arm == (
        "MoE arm: R3: the rollout's routes replayed on the "
        + {"dp": "FSDP engine (the plugin's replay)", "megatron": "Megatron engine (verl's replay)"}[engine]
    ), verdict.arm


def test_the_summary_names_the_moe_arm_and_a_replay_on_a_dense_model_is_a_problem(tmp_path):
    """Issue 73.3: the paper's with/without-R3 pair reads apart in `check`'s summary: R3 on either engine, the
    plugin's measured arm, or none on a model whose config.json (readable here) names experts (the without-R3
    arm); nothing said of a dense model without a replay; R3 on a model whose config.json names no experts is a
    problem on Megatron too (on FSDP the plugin's run checks say it)."""
    import json

    moe, dense = tmp_path / "moe", tmp_path / "dense"
    for folder, config in (
        (moe, {"model_type": "qwen3_moe", "num_experts": 128}),
        (dense, {"model_type": "qwen3", "hidden_size": 8}),
    ):
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(config))
    returned = "actor_rollout_ref.rollout.enable_rollout_routing_replay=true"
    command = [*verl_grpo_example(tmp_path), *FROM_GRPO]
    cases = (
        (
            [f"actor_rollout_ref.model.path={moe}"],
            "MoE arm: without R3 (the paper's without-R3 arm: the FSDP trainer's 128-expert routers",
        ),
        (
            [
                f"actor_rollout_ref.model.path={moe}",
                "+actor_rollout_ref.actor.fsdp_config.router_replay.mode=measure",
                returned,
            ],
            "MoE arm: without R3, its routing mismatch measured",
        ),
        ([f"actor_rollout_ref.model.path={dense}"], None),
    )
    for extra, arm in cases:
        verdict = _verdict([*command, *extra])
        assert verdict.problems == [], (extra, verdict.problems)
        assert verdict.arm is None if arm is None else verdict.arm.startswith(arm), (extra, verdict.arm)
    megatron = _megatron_example(tmp_path)
    verdict = _verdict(
        [
            *megatron[:3],
            "--config-name=ppo_megatron_trainer",
            *megatron[3:],
            *FROM_GRPO,
            f"actor_rollout_ref.model.path={dense}",
            "actor_rollout_ref.actor.megatron.router_replay.mode=R3",
            returned,
        ]
    )
    assert any("names no routed experts: a dense model routes nothing" in p for p in verdict.problems), verdict.problems
    # one rule for check, `run --dry-run` and the launch (check_run_config runs in each), on every engine
    from omegaconf import OmegaConf

    from verl_dppo.plugin.run_config import RunConfigError, check_run_config

    for strategy, section in (("megatron", "megatron"), ("veomni", "veomni"), ("fsdp", "fsdp_config")):

        def run_config(path):
            return OmegaConf.create(
                {
                    "trainer": {},
                    "algorithm": {},
                    "actor_rollout_ref": {
                        "model": {"path": str(path)},
                        "rollout": {"name": "vllm", "enable_rollout_routing_replay": True},
                        "actor": {
                            "strategy": strategy,
                            "policy_loss": {"loss_mode": "vanilla"},
                            section: {"router_replay": {"mode": "R3"}},
                        },
                    },
                }
            )

        with pytest.raises(RunConfigError, match="names no routed experts: a dense model routes nothing"):
            check_run_config(run_config(dense))
        check_run_config(run_config(moe))


def test_what_verls_example_scripts_showed(tmp_path, monkeypatch):
    """Issue 51, on verl's example scripts near 0.9.1 (switched by the README): an absolute --config-path that is
    not on this machine is "not here"; `key=` (a shell variable left unset) is a value verl's classes take; a key
    verl moved is answered with where it lives now; every `+key` Hydra refuses to add again is named in one run; a
    Dr.GRPO aggregation without loss_scale_factor is said."""
    command = _megatron_example(tmp_path)
    verdict = _verdict(
        [
            *command[:3],
            f"--config-path={tmp_path}/examples/sglang_multiturn/config",
            "--config-name=gsm8k_multiturn_grpo",
            *command[3:],
            *FROM_GRPO,
        ]
    )
    assert (
        verdict.problems == [] and verdict.exit_code == EXIT_NOT_HERE and "no such folder here" in verdict.not_here[0]
    ), (verdict.problems, verdict.not_here)
    verdict = _verdict(
        [
            *command[:3],
            "--config-name=ppo_megatron_trainer",
            *command[3:],
            *FROM_GRPO,
            "algorithm.gamma=",
            "data.return_raw_chat=",
            "actor_rollout_ref.actor.router_replay.mode=R2",
            "actor_rollout_ref.distillation.enabled=True",
            "+data.trust_remote_code=True",
            "+actor_rollout_ref.model.trust_remote_code=True",
        ]
    )
    assert len(verdict.problems) == 4, verdict.problems
    assert "did you mean actor_rollout_ref.actor.megatron.router_replay.mode?" in verdict.problems[0]
    assert "did you mean distillation.enabled?" in verdict.problems[1]
    assert all("Hydra refuses to add it again" in problem for problem in verdict.problems[2:])
    # 73.1: a `+key` for a key verl holds as null is one Hydra adds (15 of verl's Megatron scripts)
    verdict = _verdict(
        [
            *command[:3],
            "--config-name=ppo_megatron_trainer",
            *command[3:],
            *FROM_GRPO,
            "+actor_rollout_ref.actor.megatron.override_transformer_config.recompute_method=uniform",
        ]
    )
    assert verdict.problems == [], verdict.problems
    verdict = _verdict([*verl_grpo_example(tmp_path), *FROM_GRPO, "critic.model.fsdp_config.param_offload=False"])
    assert verdict.problems == [
        "critic.model.fsdp_config.param_offload=False: verl's config has no key "
        "critic.model.fsdp_config.param_offload; did you mean critic.fsdp.param_offload?"
    ]
    verdict = _verdict([*verl_grpo_example(tmp_path), *FROM_GRPO, *PAPER_LINES[:2], PAPER_LINES[3]])
    assert "loss_scale_factor unset" in verdict.rule, verdict.rule
    # verl's DeepSeek-V3 scripts leave `<path_to_dsv3_config>` to fill in: Hydra's lexer error, then what to do
    # (and a value to quote; a key Hydra cannot read gets Hydra's message alone, no quoting that would not parse)
    verdict = _verdict(
        [
            *verl_grpo_example(tmp_path),
            *FROM_GRPO,
            "actor_rollout_ref.model.path=<path_to_dsv3_config>",
            "trainer.experiment_name=qwen (7b)",
            "trainer..project_name=x",
        ]
    )
    placeholder, quoted, key = [problem for problem in verdict.problems if "override_grammar" in problem]
    assert placeholder.endswith(
        "<path_to_dsv3_config> is a placeholder the script leaves for you to fill in: give "
        "actor_rollout_ref.model.path its value (a path or a name)"
    ), placeholder
    assert quoted.endswith("only quoted: trainer.experiment_name='qwen (7b)'"), quoted
    assert key.endswith("for details"), key
    # ppo_trainer/run_deepseek7b_llm_modelscope.sh launches behind VERL_USE_MODELSCOPE=True (modelscope not here)
    command = verl_grpo_example(tmp_path)
    verdict = _verdict(["VERL_USE_MODELSCOPE=True", *command, *FROM_GRPO])
    assert verdict.problems == [] and verdict.exit_code == EXIT_NOT_HERE, verdict.problems
    assert [line for line in verdict.not_here if line.startswith("VERL_USE_MODELSCOPE=True: verl then loads")]


def test_check_prints_its_own_lines_first_and_names_what_this_machine_lacks(tmp_path):
    """73.6: a VeOmni command (VeOmni's attention notice, printed by verl's logger while the config is read): check's
    lines come first, the notice only after them with --library-output; the GPUs the command asks and a hub model
    not cached here are named in one line, with no exit code (check runs before a cluster job). Its environment asks
    verl for ModelScope's hub, which is not installed: one "not here" line, the rest read."""
    import importlib.util
    import os
    import subprocess

    from test_cli_errors import BIN

    command = [item for item in verl_grpo_example(tmp_path) if ".fsdp_config." not in item]
    assert importlib.util.find_spec("modelscope") is None  # VERL_USE_MODELSCOPE=True then stops verl's import
    done = subprocess.run(
        [
            os.path.join(BIN, "verl-dppo"),
            "check",
            "--library-output",
            *command[:3],
            "model_engine=veomni",
            *command[3:],
            *FROM_GRPO,
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "VERL_USE_MODELSCOPE": "True"},
    )
    assert done.returncode == EXIT_NOT_HERE, done.stderr[-3000:]
    lines = done.stderr.splitlines()
    ours = lines[: next(i for i, line in enumerate(lines) if "what other libraries printed meanwhile" in line)]
    assert ours and all(line.startswith("verl-dppo: ") for line in ours), lines
    assert "Replacing attn_implementation" in done.stderr.split("what other libraries printed meanwhile")[1]
    (machine,) = [line for line in ours if "launched from this machine" in line]
    assert "8 GPU(s) asked (1 node(s) x 8), 0 visible here" in machine, machine
    assert "the model Qwen/Qwen2-7B-Instruct is not in this machine's Hugging Face cache" in machine, machine
    # ppo_trainer/run_deepseek7b_llm_modelscope.sh's environment: `import verl` raises without modelscope, check read
    # the command with the variable off (a traceback, exit 1, before)
    assert [line for line in ours if line.startswith("verl-dppo: not here: VERL_USE_MODELSCOPE=True: ")], ours
    assert any(line.startswith("verl-dppo: check: trains dppo_binary_tv: ") for line in ours), ours
    assert ours[-1] == (
        "verl-dppo: check: the command passed verl's checks and the plugin's, but cannot start here: 1 thing(s) "
        "above that it needs are not on this machine (exit 3)"
    ), ours


def test_the_scripts_bench_sets_check_against_hydra_alone():
    """`bench/check_verl_scripts.py`'s second opinion (the figure issue 73's note quotes): exit 2 to what Hydra refuses
    naming Hydra's key agrees, a problem where Hydra composes is check going further, anything else where Hydra
    refuses is a miss, a traceback a crash; a config folder neither can read here is agreement."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "scripts", Path(__file__).parent.parent / "bench" / "check_verl_scripts.py"
    )
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    refused = "ConfigCompositionException: Could not override 'actor_rollout_ref.actor.kl_loss.type'."
    named = ["verl-dppo: problem: actor_rollout_ref.actor.kl_loss.type=low_var_kl: verl's config has no key ..."]
    other = ["verl-dppo: problem: data.train_batch_size=x: ..."]
    cases = [
        (dict(codes=[2], hydra=[refused], lines=named), "agree"),
        (dict(codes=[2], hydra=[refused], lines=other), "agree on the exit, not the key"),
        (dict(codes=[3], hydra=[refused], lines=[]), "miss"),
        (dict(codes=[3], hydra=["composes"], lines=[]), "agree"),
        (dict(codes=[3], hydra=["MissingConfigException: Primary config directory not found."], lines=[]), "agree"),
        (dict(codes=[2], hydra=["composes"], lines=other), "check goes further"),
        (dict(codes=[1], hydra=["composes"], lines=[]), "crash"),
        (dict(codes=[3, 2], hydra=["composes", refused], lines=[]), "agree on the exit, not the key"),
        (dict(codes=[], hydra=[], lines=[]), "no main_ppo call"),
    ]
    assert [bench.agreement(result) for result, _ in cases] == [expected for _, expected in cases]
