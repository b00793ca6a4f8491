"""`verl-dppo study`: methods x seeds through `verl-dppo run`, tabulated and drawn from verl's own JSONL logs.

The launches here are stand-ins that write what verl's file logger writes (a study's real launches take about an
hour: docs/real-model.md has one); the launch command itself is composed for real, with `--dry-run`.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from verl_dppo.cli import main
from verl_dppo.launch.ray_reaper import _stat
from verl_dppo.studies import launches, study


def _write_log(out: Path, name: str, steps: list[dict]) -> None:
    path = out / "logs" / "verl-dppo" / f"{name}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as handle:
        for step, data in enumerate(steps, start=1):
            handle.write(json.dumps({"step": step, "data": data}) + "\n")


def _fake_launch(calls: list, complete: bool = True):
    def launch(setup, method, seed, steps, out, overrides, config_dir):
        calls.append((method, seed))
        shown = steps if complete or method != "troll" else steps - 1
        rows = []
        for step in range(shown):
            row = {
                "critic/score/mean": 0.25 + 0.1 * step + 0.01 * seed,
                "timing_s/step": 50.0 + seed,
                "response_length/mean": 20.0,
            }
            if method == "troll":
                row["actor/troll/projected_frac"] = 0.5
            else:
                row["actor/pg_clipfrac"] = 0.01 * (1 + step)
            if method.startswith("dppo"):
                row["actor/dppo/mismatch_tv_mean"] = 1e-3
            if "topk" in method:
                row["actor/dppo/rollout_topk_mass_mean"] = 0.9
            rows.append(row)
        _write_log(out, study.run_name(setup, method, seed), rows)
        return 0 if shown == steps else 1

    return launch


def test_the_study_runs_every_method_and_seed_then_tabulates_and_draws_them(tmp_path, capsys):
    calls = []
    methods = ["grpo_clip_higher", "dppo_topk_tv", "troll"]
    code = study.run_study("smollm2", methods, [0, 1], 3, tmp_path, ["x=1"], launch=_fake_launch(calls))
    assert code == 0
    assert calls == [(m, s) for s in (0, 1) for m in methods]  # seed-major
    saved = json.loads((tmp_path / "study.json").read_text())
    summary = saved["summary"]
    topk = summary["dppo_topk_tv"]
    # final reward: the last 2 steps (0.35, 0.45) of each seed, seeds 0 and 1 -> 0.40 and 0.41
    assert topk["final_reward"] == pytest.approx(0.405) and topk["final_reward_sd"] == pytest.approx(0.00707, abs=1e-4)
    assert topk["first_reward"] == pytest.approx(0.255) and topk["steps"] == 3
    assert topk["acted"] == pytest.approx(0.02) and topk["topk_mass"] == pytest.approx(0.9)
    assert summary["troll"]["troll_projected"] == pytest.approx(0.5) and summary["troll"]["acted"] == pytest.approx(0.5)
    assert summary["grpo_clip_higher"]["mismatch_tv"] is None
    assert saved["overrides"] == ["x=1"] and saved["steps"] == 3
    printed = capsys.readouterr().out
    assert "dppo_topk_tv" in printed and "50.00%" in printed  # TROLL's column: the tokens it projected
    assert (tmp_path / "study.png").stat().st_size > 10_000

    # a second call with the same settings finds every log complete and launches nothing
    again = []
    assert study.run_study("smollm2", methods, [0, 1], 3, tmp_path, ["x=1"], launch=_fake_launch(again)) == 0
    assert again == []


def test_a_run_that_stops_short_is_named_and_left_out_of_the_summary(tmp_path, capsys):
    launch = _fake_launch([], complete=False)
    code = study.run_study("smollm2", ["dppo_binary_tv", "troll"], [0], 2, tmp_path, [], launch=launch)
    assert code == 1
    err = capsys.readouterr().err
    assert "incomplete: study-smollm2-troll-seed0 (1 of 2 steps" in err
    summary = json.loads((tmp_path / "study.json").read_text())["summary"]
    assert summary["dppo_binary_tv"]["steps"] == 2 and "troll" not in summary

    # seed 0 complete, seed 1 cut short after its first step: its early reward is not averaged into the final one
    def one_short(setup, method, seed, steps, out, overrides, config_dir):
        rewards = [0.9, 0.9] if seed == 0 else [0.1]
        _write_log(out, study.run_name(setup, method, seed), [{"critic/score/mean": r} for r in rewards])
        return 0 if seed == 0 else 1

    assert study.run_study("smollm2", ["dppo_binary_tv"], [0, 1], 2, tmp_path / "b", [], launch=one_short) == 1
    row = json.loads((tmp_path / "b" / "study.json").read_text())["summary"]["dppo_binary_tv"]
    assert row["final_reward"] == pytest.approx(0.9) and row["seeds"] == [0] and row["incomplete_seeds"] == [1]
    assert row["final_reward_sd"] is None  # one seed: no spread, not a spread of 0
    printed = capsys.readouterr().out
    assert "0.900 (    -)" in printed and "left out, stopped short: seed 1" in printed


def test_a_log_is_reused_only_under_the_same_run_arguments(tmp_path, capsys):
    calls = []
    assert study.run_study("smollm2", ["dppo_binary_tv"], [0], 3, tmp_path, ["x=1"], launch=_fake_launch(calls)) == 0
    assert study.run_study("smollm2", ["dppo_binary_tv"], [0], 3, tmp_path, ["x=1"], launch=_fake_launch(calls)) == 0
    assert len(calls) == 1  # resumed: the same arguments, every step logged
    # another study in the same DIR (fewer steps, another override): its 3-step log is not read as this one's
    assert study.run_study("smollm2", ["dppo_binary_tv"], [0], 2, tmp_path, ["x=2"], launch=_fake_launch(calls)) == 0
    assert len(calls) == 2
    # a launch that dies before verl writes its log: the earlier log was removed, the run is 0 of 2 steps
    assert (
        study.run_study(
            "smollm2", ["dppo_binary_tv"], [0], 2, tmp_path, ["x=3"], launch=lambda *a: calls.append("died") or 1
        )
        == 1
    )
    assert "(0 of 2 steps" in capsys.readouterr().err
    # a log without the arguments it was written under (an older study's) is launched again
    name = study.run_name("smollm2", "dppo_binary_tv", 0)
    _write_log(tmp_path, name, [{"critic/score/mean": 0.5}] * 2)
    (tmp_path / "runs" / f"{name}.args.json").unlink()
    assert study.run_study("smollm2", ["dppo_binary_tv"], [0], 2, tmp_path, ["x=3"], launch=_fake_launch(calls)) == 0
    assert len(calls) == 4
    # --report launches nothing and reads the logs as they are, a log without its arguments too
    (tmp_path / "runs" / f"{name}.args.json").unlink()
    assert (
        study.run_study(
            "smollm2",
            ["dppo_binary_tv", "troll"],
            [0],
            2,
            tmp_path,
            ["x=4"],
            launch=lambda *a: pytest.fail("launched"),
            report=True,
        )
        == 1
    )  # troll: no log
    saved = json.loads((tmp_path / "study.json").read_text())
    assert saved["summary"]["dppo_binary_tv"]["steps"] == 2 and "troll" not in saved["summary"]


def test_a_log_cut_mid_line_or_with_missing_rewards_is_read_not_a_crash(tmp_path):
    name = study.run_name("smollm2", "troll", 0)
    _write_log(tmp_path, name, [{"critic/score/mean": 0.1}, {"critic/score/mean": None}, {"critic/score/mean": None}])
    path = tmp_path / "logs" / "verl-dppo" / f"{name}.jsonl"
    with open(path, "a") as handle:
        handle.write('{"step": 4, "data": {"critic/sc')  # killed while writing
    assert len(study.read_log(path)) == 3 and len(study.read_log(path, 2)) == 2
    runs = [{"method": "troll", "seed": s, "series": study._series(study.read_log(path, 3))} for s in (0, 1)]
    row = study.summarize(runs)["troll"]  # the last 2 rewards are null (verl writes NaN as null): no final reward
    assert row["final_reward"] is None and row["final_reward_sd"] is None and row["first_reward"] == 0.1


def test_a_resumed_run_keeps_each_steps_last_record(tmp_path):
    name = study.run_name("smollm2", "troll", 0)
    _write_log(tmp_path, name, [{"critic/score/mean": 0.1}, {"critic/score/mean": 0.2}])
    _write_log(tmp_path, name, [{"critic/score/mean": 0.3}])  # step 1 again
    assert [s["critic/score/mean"] for s in study.read_log(tmp_path / "logs" / "verl-dppo" / f"{name}.jsonl")] == [
        0.3,
        0.2,
    ]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--seeds", "0,0"], "--seeds 0,0: give one or more distinct"),
        (["--seeds", "a"], "--seeds a: give whole numbers"),
        (["--steps", "0"], "--steps 0: give at least 1"),
        (["--methods", "dppo_tv"], "unknown method 'dppo_tv'"),
        (["--methods", "troll,troll"], "--methods troll,troll: give one or more distinct"),
        (["actor_rollout_ref.actor.optim.lr=abc"], "lr"),
        (["trainer.experiment_name=mine"], "the study sets trainer.experiment_name for each run itself"),
        (["+data.seed=7"], "the study sets data.seed for each run itself (give --seeds)"),
        (["trainer.total_training_steps=3"], "(give --steps)"),
    ],
)
def test_bad_input_is_one_line_before_any_launch(tmp_path, monkeypatch, capsys, argv, message):
    monkeypatch.setattr(study, "run_study", lambda *a, **k: pytest.fail("launched"))
    assert main(["study", "--out", str(tmp_path / "out"), *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("verl-dppo: error:") and message in err, err


def test_the_launch_is_a_real_run_command_with_the_studys_settings_first(tmp_path, monkeypatch):
    captured = {}
    monkeypatch.setattr(study, "run_study", lambda *a, **k: captured.update(args=a) or 0)
    assert main(["study", "--out", str(tmp_path), "--steps", "3", "actor_rollout_ref.actor.optim.lr=2e-5"]) == 0
    setup, methods, seeds, steps, out, overrides, config_dir = captured["args"]
    assert (setup, methods, seeds, steps) == ("smollm2", list(study.METHODS), [0, 1, 2], 3)
    assert overrides == [*study.CPU_SETTINGS, "actor_rollout_ref.actor.optim.lr=2e-5"]  # the user's last: it wins
    # options and overrides in any order, as `verl-dppo run` takes them
    assert (
        main(
            [
                "study",
                "--out",
                str(tmp_path),
                "trainer.logger=[console]",
                "--steps",
                "2",
                "actor_rollout_ref.actor.optim.lr=3e-5",
                "--seeds",
                "4",
                "--methods",
                "troll",
            ]
        )
        == 0
    )
    assert captured["args"][1:4] == (["troll"], [4], 2)
    assert captured["args"][5][-2:] == ["trainer.logger=[console]", "actor_rollout_ref.actor.optim.lr=3e-5"]

    commands = []
    monkeypatch.setattr(launches, "run_launch", lambda command, stdout: commands.append(command) or 0)
    study._launch("smollm2", "dppo_topk_tv", 1, 3, tmp_path, overrides, [])
    (command,) = commands
    dry = subprocess.run(
        [*command[: command.index("--method") + 2], "--dry-run", *command[command.index("--method") + 2 :]],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "DPPO_ROOT": str(tmp_path / "root")},
    )
    assert dry.returncode == 0, dry.stderr[-3000:]
    config = yaml.safe_load(dry.stdout)
    actor = config["actor_rollout_ref"]["actor"]
    assert actor["optim"]["lr"] == 2e-5 and actor["policy_loss"]["loss_mode"] == "dppo_topk_tv"
    assert actor["fsdp_config"]["mixed_precision"]["param_dtype"] == "bf16"
    assert config["trainer"]["total_training_steps"] == 3 and config["data"]["seed"] == 1
    assert config["actor_rollout_ref"]["rollout"]["seed"] == 1
    assert config["trainer"]["experiment_name"] == "study-smollm2-dppo_topk_tv-seed1"
    assert config["ray_kwargs"]["ray_init"]["runtime_env"]["env_vars"]["VERL_FILE_LOGGER_ROOT"] == str(
        tmp_path / "logs"
    )


# A stand-in launch: writes its pid, then would train for two minutes.
LAUNCH = (
    "import os, sys, time; open(sys.argv[1] + '.tmp', 'w').write(str(os.getpid())); "
    "os.replace(sys.argv[1] + '.tmp', sys.argv[1]); time.sleep(120)"
)
# The study command as a user runs it, its launch (`launches.run_launch`'s command) replaced by the stand-in; or
# `verl-dppo mismatch`'s way of launching (`launches.follow_launch`).
DRIVERS = {
    "study": "from verl_dppo.studies import launches; from verl_dppo.cli import main; real = launches.run_launch; "
    "launches.run_launch = lambda command, stdout: real([sys.executable, '-c', LAUNCH, PID], stdout); "
    "sys.exit(main(['study', '--out', OUT, '--methods', 'dppo_binary_tv', '--seeds', '0']))",
    "follow_launch": "from verl_dppo.studies.launches import follow_launch; "
    "sys.exit(follow_launch([sys.executable, '-c', LAUNCH, PID], OUT + '/launch.log', None, print))",
}


@pytest.mark.parametrize(
    "driver, number, ignored", [("study", signal.SIGTERM, signal.SIGHUP), ("follow_launch", signal.SIGHUP, None)]
)
def test_a_study_ended_by_a_signal_ends_its_launch(tmp_path, driver, number, ignored):
    """`kill` (SIGTERM) or a closed terminal (SIGHUP) on the command alone reaches none of its launch: the launch (a
    `verl-dppo run`, whose own watchdog then ends its Ray instance) must be ended by the command itself, which then
    ends as the signal ends it. A signal the command ignores (`nohup verl-dppo study ...`: SIGHUP) ends neither."""
    pid_file = tmp_path / "launch.pid"
    code = f"import sys\nLAUNCH, PID, OUT = {LAUNCH!r}, {str(pid_file)!r}, {str(tmp_path)!r}\n{DRIVERS[driver]}\n"

    def dispositions():  # the command's own, not what it inherits (a suite run under `nohup` ignores SIGHUP)
        for each in (signal.SIGTERM, signal.SIGHUP):
            signal.signal(each, signal.SIG_IGN if each == ignored else signal.SIG_DFL)

    command = subprocess.Popen(
        [sys.executable, "-c", code],
        preexec_fn=dispositions,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        until = time.monotonic() + 240
        while not pid_file.exists() and command.poll() is None and time.monotonic() < until:
            time.sleep(0.2)
        assert pid_file.exists(), command.stderr.read() if command.poll() is not None else "no launch in 240 s"
        launch = int(pid_file.read_text())
        if ignored:
            command.send_signal(ignored)
            time.sleep(1)
            assert command.poll() is None and _stat(launch) is not None  # both go on
        command.send_signal(number)
        assert command.wait(timeout=60) == -number, command.stderr.read()
        assert _stat(launch) is None, "the launch outlived the command"
    finally:
        command.kill()
        command.wait()
