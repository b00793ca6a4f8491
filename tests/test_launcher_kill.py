"""Issue 24.8: after a SIGKILL of `verl-dppo run`, Ray's processes (the dashboard and runtime-env agents among them)
stayed orphaned for minutes. The local Ray instance `run` starts ends with it (verl_dppo/launch/ray_reaper.py), and a
later launch trains."""

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
def test_a_killed_launcher_leaves_no_ray_process_and_the_next_launch_trains(tmp_path):
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

    result = subprocess.run(_command(1), capture_output=True, text=True, env=env, cwd=tmp_path, timeout=400)
    assert result.returncode == 0, result.stderr[-3000:]
    log = tmp_path / "root" / "logs" / "verl-dppo" / "cpu_tiny-dppo_binary_tv-sync.jsonl"
    assert [json.loads(line)["step"] for line in log.read_text().splitlines()] == [1], result.stderr[-3000:]


def descendants_alive(pid: int, started: int) -> bool:
    from verl_dppo.launch.ray_reaper import _stat

    stat = _stat(pid)
    return stat is not None and stat[1] == started
