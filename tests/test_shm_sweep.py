"""Issue 34.7: the launcher's watchdog sweeps only the /dev/shm segments its own run's processes created (mapped or
held open): a segment another job created after the launch, left unmapped, stays."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from verl_dppo.launch import ray_reaper

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux") or not os.path.isdir(ray_reaper.SHM_DIR),
    reason="the reaper reads /proc and /dev/shm",
)

# A process that creates a segment, maps it until its stdin closes, then exits without unlinking it (what a vLLM
# engine killed at a job's end leaves).
HOLDER = """
import sys
from multiprocessing import resource_tracker, shared_memory
shm = shared_memory.SharedMemory(create=True, size=4096)
resource_tracker.unregister(shm._name, "shared_memory")
print(shm.name, flush=True)
sys.stdin.read()
"""


def _holder(env: dict) -> tuple[subprocess.Popen, str]:
    process = subprocess.Popen(
        [sys.executable, "-c", HOLDER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True
    )
    return process, process.stdout.readline().strip().lstrip("/")


def test_the_sweep_takes_the_runs_segments_and_leaves_another_jobs():
    before = ray_reaper.segments()
    run = ray_reaper.RunSegments(before, run_id="test-run-1")
    env = {k: v for k, v in os.environ.items() if k != ray_reaper.RUN_MARKER}
    ours, our_name = _holder({**env, ray_reaper.RUN_MARKER: "test-run-1"})
    other_run, other_run_name = _holder({**env, ray_reaper.RUN_MARKER: "test-run-2"})
    foreign, foreign_name = _holder(env)
    try:
        assert run.note() == {our_name}  # mapped by a process of the run: noted; the others are not
        for process in (ours, other_run, foreign):
            process.stdin.close()
            process.wait(timeout=30)
        assert {our_name, other_run_name, foreign_name} <= ray_reaper.segments() - ray_reaper.mapped_segments()
        start = time.monotonic()
        assert ray_reaper.sweep_segments(run, wait_s=30) == [our_name]
        assert time.monotonic() - start < 10  # no process of the run left: it does not wait
        left = ray_reaper.segments()
        assert our_name not in left and {other_run_name, foreign_name} <= left
    finally:
        for name in (our_name, other_run_name, foreign_name):
            try:
                os.unlink(os.path.join(ray_reaper.SHM_DIR, name))
            except OSError:
                pass
