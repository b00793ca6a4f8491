"""Issue 18.7: two launches under one `trainer.experiment_name` share verl's checkpoint folder and JSONL log, and
verl's `resume_mode=auto` resumes whatever checkpoint is there. `verl-dppo run` records each launch's setup,
method and loss mode beside both, and warns (one line) when a launch would resume or overwrite another's run.

The first run is launched through `run`'s own `_launch`, with verl's `run_ppo` replaced by a stand-in trainer that
writes what verl's trainer writes: the JSONL through verl's `FileLogger` in the environment `run` hands the Ray
actors, and a checkpoint in verl's layout, which verl's own `find_latest_ckpt_path` then finds to resume.
"""

from __future__ import annotations

import os

import pytest
from omegaconf import OmegaConf

from verl_dppo import cli
from verl_dppo.cli import launch
from verl_dppo.cli.compose import compose_recipe
from verl_dppo.cli.run_logs import pin_file_logger
from verl_dppo.cli.run_record import CHECKPOINT_RECORD, clash_warning, log_path

VERL_TV = ["actor_rollout_ref.actor.policy_loss.loss_mode=dppo_tv", "actor_rollout_ref.actor.clip_ratio_low=0.15",
           "actor_rollout_ref.actor.clip_ratio_high=0.15", "actor_rollout_ref.actor.clip_ratio_c=10000"]


def composed(method="dppo_binary_tv", overrides=()):
    config = compose_recipe("sanity_1p5b", method, list(overrides))
    pin_file_logger(config)
    return config


def fake_trainer(steps_saved=50):
    """What verl's trainer leaves behind: its FileLogger's JSONL (in the runtime_env's environment) and a
    checkpoint (`global_step_N/`, `latest_checkpointed_iteration.txt`), as trainer_base._save_checkpoint writes."""

    def run_ppo(config, task_runner_class=None):
        from verl.utils.tracking import FileLogger

        env_vars = config.ray_kwargs.ray_init.runtime_env.env_vars
        before = os.environ.get("VERL_FILE_LOGGER_ROOT")
        os.environ["VERL_FILE_LOGGER_ROOT"] = env_vars.VERL_FILE_LOGGER_ROOT
        try:
            logger = FileLogger(config.trainer.project_name, config.trainer.experiment_name)
            for step in range(1, 4):
                logger.log({"critic/score/mean": step / 10}, step)
            logger.finish()
        finally:
            if before is None:
                del os.environ["VERL_FILE_LOGGER_ROOT"]
            else:
                os.environ["VERL_FILE_LOGGER_ROOT"] = before
        folder = config.trainer.default_local_dir
        os.makedirs(os.path.join(folder, f"global_step_{steps_saved}", "actor"))
        with open(os.path.join(folder, "latest_checkpointed_iteration.txt"), "w") as handle:
            handle.write(str(steps_saved))

    return run_ppo


@pytest.fixture
def first_run(tmp_path, monkeypatch, capsys):
    """`verl-dppo run sanity_1p5b --method dppo_binary_tv` launched and checkpointed at step 50."""
    import verl.trainer.main_ppo as main_ppo
    from verl.utils.checkpoint.checkpoint_manager import find_latest_ckpt_path

    monkeypatch.setenv("DPPO_ROOT", str(tmp_path / "root"))
    for name in ("VERL_FILE_LOGGER_ROOT", "VERL_FILE_LOGGER_PATH"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(main_ppo, "run_ppo", fake_trainer())
    config = composed()
    assert clash_warning(config) is None  # nothing there yet
    assert launch._launch(config, None) == 0
    folder = str(config.trainer.default_local_dir)
    assert find_latest_ckpt_path(folder) == os.path.join(folder, "global_step_50")  # verl would resume this
    assert os.path.isfile(os.path.join(folder, CHECKPOINT_RECORD))
    assert os.path.getsize(log_path(config)) > 0
    capsys.readouterr()
    return config


def run_warnings(capsys, argv):
    assert cli.main(["run", "sanity_1p5b", *argv, "--dry-run"]) == 0
    return [line for line in capsys.readouterr().err.splitlines() if "would resume" in line or "would overwrite"
            in line or " and continue" in line]


def test_the_readme_comparison_warns_on_one_shared_name_and_not_with_its_own(first_run, capsys):
    (line,) = run_warnings(capsys, ["--method", "dppo_binary_tv", *VERL_TV])
    assert line.startswith("verl-dppo: warning: this launch (sanity_1p5b --method dppo_binary_tv, loss_mode dppo_tv)")
    assert "would resume step 50 of sanity_1p5b --method dppo_binary_tv (loss_mode dppo_binary_tv)" in line
    # the resumed run keeps the log's lines up to its checkpoint (patches/file_logger.py) and writes after them
    assert f"and continue its {log_path(first_run)} after step 50:" in line and "trainer.experiment_name=" in line
    # the README's second run, with a name of its own: nothing to resume, nothing overwritten
    assert run_warnings(capsys, ["--method", "dppo_binary_tv", *VERL_TV,
                                 "trainer.experiment_name=sanity_1p5b-verl_dppo_tv"]) == []
    # the same run launched again resumes its own checkpoint: verl's resume_mode=auto, as intended
    assert run_warnings(capsys, ["--method", "dppo_binary_tv"]) == []


def test_another_method_under_the_same_name_and_a_run_of_unknown_method(first_run):
    other = composed("dppo_binary_kl", ["trainer.experiment_name=sanity_1p5b-dppo_binary_tv"])
    assert "would resume step 50 of sanity_1p5b --method dppo_binary_tv" in clash_warning(other)
    # resume_mode=disable: nothing is resumed, but verl's FileLogger still truncates the log ("wb")
    fresh = composed("dppo_binary_kl", ["trainer.experiment_name=sanity_1p5b-dppo_binary_tv",
                                        "trainer.resume_mode=disable"])
    warning = clash_warning(fresh)
    assert "resume" not in warning.split("would", 1)[1].split(":", 1)[0]
    assert "would overwrite the log of sanity_1p5b --method dppo_binary_tv (loss_mode dppo_binary_tv), " in warning
    # checkpoints a plain main_ppo launch wrote carry no record: said so, not guessed
    os.remove(os.path.join(str(first_run.trainer.default_local_dir), CHECKPOINT_RECORD))
    assert "resume step 50 of a run whose method is not recorded" in clash_warning(composed())


def test_a_log_root_from_the_shell_is_where_the_log_is_looked_for(tmp_path, monkeypatch):
    monkeypatch.setenv("DPPO_ROOT", str(tmp_path / "root"))
    monkeypatch.setenv("VERL_FILE_LOGGER_ROOT", str(tmp_path / "elsewhere"))
    monkeypatch.delenv("VERL_FILE_LOGGER_PATH", raising=False)
    config = composed()
    assert log_path(config) == str(tmp_path / "elsewhere" / "verl-dppo" / "sanity_1p5b-dppo_binary_tv.jsonl")
    assert log_path(OmegaConf.merge(config, {"trainer": {"logger": ["console"]}})) is None
