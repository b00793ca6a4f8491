"""Issue 18.7: two launches under one `trainer.experiment_name` share verl's checkpoint folder and JSONL log, and
verl's `resume_mode=auto` resumes whatever checkpoint is there. `verl-dppo run` records each launch's setup,
method and loss mode beside both, and warns (one line) when a launch would resume or overwrite another's run.

The first run is launched through `run`'s own `_launch`, with verl's `run_ppo` replaced by a stand-in trainer that
writes what verl's trainer writes: the JSONL through verl's `FileLogger` in the environment `run` hands the Ray
actors, and a checkpoint in verl's layout, which verl's own `find_latest_ckpt_path` then finds to resume.
"""

from __future__ import annotations

import json
import os

import pytest
from omegaconf import OmegaConf

from verl_dppo import cli
from verl_dppo.launch import commands as launch
from verl_dppo.launch.compose import compose_recipe
from verl_dppo.launch.run_logs import pin_file_logger
from verl_dppo.launch.run_record import CHECKPOINT_RECORD, clash_warning, log_path

VERL_TV = [
    "actor_rollout_ref.actor.policy_loss.loss_mode=dppo_tv",
    "actor_rollout_ref.actor.clip_ratio_low=0.15",
    "actor_rollout_ref.actor.clip_ratio_high=0.15",
    "actor_rollout_ref.actor.clip_ratio_c=10000",
]


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
    command = "verl-dppo run sanity_1p5b --method dppo_binary_tv"
    assert launch._launch(config, None, command) == 0
    folder = str(config.trainer.default_local_dir)
    assert find_latest_ckpt_path(folder) == os.path.join(folder, "global_step_50")  # verl would resume this
    with open(os.path.join(folder, CHECKPOINT_RECORD)) as record:  # the command line too (issue 43.4)
        assert json.load(record)["command"] == command
    assert os.path.getsize(log_path(config)) > 0
    capsys.readouterr()
    return config


def run_warnings(capsys, argv):
    assert cli.main(["run", "sanity_1p5b", *argv, "--dry-run"]) == 0
    return [
        line
        for line in capsys.readouterr().err.splitlines()
        if "would resume" in line or "would overwrite" in line or " and continue" in line
    ]


def test_the_readme_comparison_warns_on_one_shared_name_and_not_with_its_own(first_run, capsys):
    # the comparison with verl's dppo_tv is named after both (sanity_1p5b-dppo_binary_tv+dppo_tv): nothing shared
    assert run_warnings(capsys, ["--method", "dppo_binary_tv", *VERL_TV]) == []
    # given the first run's name, it would resume that run: warned, naming both
    (line,) = run_warnings(
        capsys, ["--method", "dppo_binary_tv", *VERL_TV, "trainer.experiment_name=sanity_1p5b-dppo_binary_tv"]
    )
    assert line.startswith(
        "verl-dppo: warning: this launch (sanity_1p5b --method dppo_binary_tv --trainer-mode sync, loss_mode dppo_tv)"
    )
    assert (
        "would resume step 50 of sanity_1p5b --method dppo_binary_tv --trainer-mode sync (loss_mode dppo_binary_tv)"
    ) in line
    # the resumed run keeps the log's lines up to its checkpoint (patches/file_logger.py) and writes after them
    assert f"and continue its {log_path(first_run)} after step 50:" in line and "trainer.experiment_name=" in line
    # the README's second run, with a name of its own: nothing to resume, nothing overwritten
    assert (
        run_warnings(
            capsys, ["--method", "dppo_binary_tv", *VERL_TV, "trainer.experiment_name=sanity_1p5b-verl_dppo_tv"]
        )
        == []
    )
    # the same run launched again resumes its own checkpoint: verl's resume_mode=auto, as intended
    assert run_warnings(capsys, ["--method", "dppo_binary_tv"]) == []


def test_another_method_under_the_same_name_and_a_run_of_unknown_method(first_run):
    other = composed("dppo_binary_kl", ["trainer.experiment_name=sanity_1p5b-dppo_binary_tv"])
    assert "would resume step 50 of sanity_1p5b --method dppo_binary_tv" in clash_warning(other)
    # resume_mode=disable: nothing is resumed, but verl's FileLogger still truncates the log ("wb")
    fresh = composed(
        "dppo_binary_kl", ["trainer.experiment_name=sanity_1p5b-dppo_binary_tv", "trainer.resume_mode=disable"]
    )
    warning = clash_warning(fresh)
    assert "resume" not in warning.split("would", 1)[1].split(":", 1)[0]
    assert (
        "would overwrite the log of sanity_1p5b --method dppo_binary_tv --trainer-mode sync (loss_mode "
        "dppo_binary_tv), "
    ) in warning
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


def _steps(path):
    import json

    return [
        (r["step"], "val" if all(k.startswith("val-") for k in r["data"]) else "train")
        for r in map(json.loads, open(path).read().splitlines())
    ]


@pytest.mark.parametrize("validate", [False, True])
def test_a_resumed_log_keeps_every_record_once(tmp_path, monkeypatch, validate):
    """Issue 24.2: verl's FileLogger as the plugin patches it, a run killed after step 3 (its checkpoint at step 2) and
    resumed: with `val_before_train` verl logs a validation at the checkpoint's step 2 before training step 3 again.
    Every training step is in the log once, step 2's included; the lines the killed run wrote after its checkpoint
    are replaced, not duplicated; a validation at the resumed step replaces one the killed run logged there."""
    import verl_dppo.plugin  # noqa: F401  (the import hook that patches verl.utils.tracking)
    from verl.utils.tracking import FileLogger

    monkeypatch.setenv("VERL_FILE_LOGGER_PATH", str(tmp_path / "run.jsonl"))
    first = FileLogger("p", "e")
    if validate:
        first.log({"val-core/acc": 0.1}, 0)
    for step in (1, 2, 3):
        first.log({"critic/score/mean": step / 10}, step)
    first.fp.write(b'{"step": 4, "da')  # a line cut short by the kill
    first.finish()
    resumed = FileLogger("p", "e")
    if validate:
        resumed.log({"val-core/acc": 0.2}, 2)
    for step in (3, 4):
        resumed.log({"critic/score/mean": step}, step)
    resumed.finish()
    train = [step for step, kind in _steps(tmp_path / "run.jsonl") if kind == "train"]
    assert train == [1, 2, 3, 4]
    assert [step for step, kind in _steps(tmp_path / "run.jsonl") if kind == "val"] == ([0, 2] if validate else [])
    # a resume of the resumed run at the same checkpoint: its validation at step 2 replaces the earlier one
    if validate:
        again = FileLogger("p", "e")
        again.log({"val-core/acc": 0.3}, 2)
        again.finish()
        assert _steps(tmp_path / "run.jsonl") == [(0, "val"), (1, "train"), (2, "train"), (2, "val")]
    # a fresh run under the same name starts an empty log, with or without its validation at step 0
    fresh = FileLogger("p", "e")
    fresh.log({"val-core/acc": 0.5} if validate else {"critic/score/mean": 1.0}, 0 if validate else 1)
    fresh.finish()
    assert len(_steps(tmp_path / "run.jsonl")) == 1


def test_every_setup_names_its_trainer_modes_apart():
    """Issue 24.3: a sync and an async run of one recipe get their own experiment name (checkpoints and log)."""
    from verl_dppo.launch.compose import list_recipes

    setups = [info.name for info in list_recipes()["setup"]]
    assert "sanity_1p5b" in setups and "cpu_tiny" in setups
    for setup in setups:
        modes = ("sync", "separate_async", "colocate_async") if setup == "sanity_1p5b" else ("sync", "separate_async")
        names = {
            mode: str(compose_recipe(setup, "dppo_binary_tv", trainer_mode=mode).trainer.experiment_name)
            for mode in modes
        }
        assert len(set(names.values())) == len(modes), (setup, names)


def test_an_async_launch_under_a_sync_runs_name_is_warned(first_run):
    """The clash warning compares the trainer mode too: an async launch told to use the sync run's name would resume
    its checkpoint and continue its log. A record written before the mode was recorded counts as sync."""
    import json

    name = str(first_run.trainer.experiment_name)
    async_run = compose_recipe(
        "sanity_1p5b", "dppo_binary_tv", [f"trainer.experiment_name={name}"], trainer_mode="separate_async"
    )
    pin_file_logger(async_run)
    warning = clash_warning(async_run)
    assert warning.startswith("this launch (sanity_1p5b --method dppo_binary_tv --trainer-mode separate_async,")
    assert "would resume step 50 of sanity_1p5b --method dppo_binary_tv --trainer-mode sync" in warning
    assert clash_warning(composed()) is None  # the sync run itself resumes its own, silently
    record = os.path.join(str(first_run.trainer.default_local_dir), CHECKPOINT_RECORD)
    old = {k: v for k, v in json.load(open(record)).items() if k != "trainer_mode"}
    json.dump(old, open(record, "w"))
    assert "would resume" not in (clash_warning(composed()) or "")
    assert "would resume step 50" in clash_warning(async_run)
