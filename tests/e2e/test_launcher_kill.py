"""Issue 24.8: after a SIGKILL of `verl-dppo run`, Ray's processes (the dashboard and runtime-env agents among them)
stayed orphaned for minutes. The local Ray instance `run` starts ends with it (verl_dppo/launch/ray_reaper.py), and the
next launch trains: `verl-dppo check --rehearse` on verl's GRPO example (issue 43; one launch for both checks, each
launch 2-3 minutes on a slow 2-core machine)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from verl_dppo.launch.ray_reaper import GRACE_S, descendants

pytestmark = pytest.mark.e2e

VERL_DPPO = str(Path(sys.executable).parent / "verl-dppo")


def _command(steps: int) -> list[str]:
    return [VERL_DPPO, "run", "cpu_tiny", "--method", "dppo_binary_tv", f"trainer.total_training_steps={steps}",
            "trainer.save_freq=-1"]


def _names(pids) -> list[str]:
    names = []
    for pid in pids:
        try:
            names.append(Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:80])
        except OSError:
            pass
    return names


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the reaper reads /proc")
def test_a_killed_launcher_leaves_no_ray_process_and_the_next_launch_rehearses_a_command(tmp_path):
    # a user's shell: no RAY_ADDRESS (run starts the local instance), no VERL_* left by other tests of this process
    env = {k: v for k, v in os.environ.items() if not k.startswith("VERL_") and k != "RAY_ADDRESS"}
    env.update(DPPO_ROOT=str(tmp_path / "root"), PYTHONUNBUFFERED="1")
    log = open(tmp_path / "killed.log", "w")
    launcher = subprocess.Popen(_command(3), stdout=log, stderr=subprocess.STDOUT, env=env, cwd=tmp_path)
    noted: dict[int, int] = {}
    deadline = time.monotonic() + 240
    try:
        # until Ray's agents and the training worker are up (the processes that outlived the launcher)
        while time.monotonic() < deadline and launcher.poll() is None:
            noted.update(descendants(launcher.pid))
            names = " ".join(_names(noted))
            if "DashboardAgent" in names and "RuntimeEnvAgent" in names and "WorkerDict" in names:
                break
            time.sleep(0.5)
        assert launcher.poll() is None, (tmp_path / "killed.log").read_text()[-3000:]
        noted.update(descendants(launcher.pid))
        assert "raylet" in " ".join(_names(noted)), _names(noted)
    finally:
        launcher.send_signal(signal.SIGKILL)
        launcher.wait()
    left = noted
    until = time.monotonic() + GRACE_S + 20  # Ray's own shutdown on SIGTERM, then the watchdog's SIGKILL
    while time.monotonic() < until:
        left = {pid: t for pid, t in left.items() if descendants_alive(pid, t)}
        if not left:
            break
        time.sleep(0.5)
    assert not left, f"still running after the launcher's SIGKILL: {_names(left)}"

    # The next launch on this machine: `check --rehearse` of verl's GRPO example switched to dppo_binary_tv, one step
    # through verl's trainer on a local Ray instance of its own (its model and data from the killed launch's build).
    rehearsed(tmp_path, env)


def rehearsed(tmp_path: Path, env: dict) -> None:
    """verl's GRPO example switched to dppo_binary_tv, rehearsed for one step on this CPU through verl's trainer:
    exit 0, the worker's values in effect are the command's (inherited 0.2 / 0.2 / cap 3), its KL loss logged, the
    run record's command the one `check` composed (tests/test_check.py checks the rehearsal's composition)."""
    from test_check import FROM_GRPO, verl_grpo_example

    command = [VERL_DPPO, "check", "--rehearse", "--steps", "1", *verl_grpo_example(tmp_path), FROM_GRPO[0]]
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=900, cwd=str(tmp_path))
    log = result.stdout + result.stderr
    assert result.returncode == 0, log[-3000:]
    # issue 43.4: the console leads with what it rehearses; the `run` line is in the run record; no K for binary
    assert "verl-dppo: check: rehearsing dppo_binary_tv as your command sets it" in log, log[-3000:]
    (in_effect,) = {line.split("verl-dppo ", 1)[1] for line in log.splitlines() if "dppo_binary_tv in effect:" in line}
    assert in_effect.startswith("dppo_binary_tv in effect: delta_low=0.2 delta_high=0.2 ratio_cap=3"), log[-3000:]
    assert "topk" not in in_effect, in_effect
    jsonl = Path(env["DPPO_ROOT"]) / "logs" / "verl-dppo" / "cpu_tiny-rehearsal+dppo_binary_tv-sync.jsonl"
    (record,) = [json.loads(line) for line in jsonl.read_text().splitlines()]
    assert record["step"] == 1 and "actor/kl_loss" in record["data"], record
    run = json.loads(jsonl.with_suffix(".run.json").read_text())
    assert run["command"].startswith("verl-dppo run cpu_tiny --method grpo_clip_higher "), run
    assert "++actor_rollout_ref.actor.policy_loss.loss_mode=dppo_binary_tv" in run["command"], run


def descendants_alive(pid: int, started: int) -> bool:
    from verl_dppo.launch.ray_reaper import _stat

    stat = _stat(pid)
    return stat is not None and stat[1] == started
