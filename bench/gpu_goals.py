"""The GPU goals of issues 72 and 75, each read from a `bench/gpu_suite.py` result beside its measured value.

    from gpu_goals import goal_rows, goals_markdown
    rows = goal_rows(json.loads(Path("OUT/gpu_suite.json").read_text()))

`bench/gpu_suite.py` writes the table first in OUT/gpu_suite.md and the rows under "goals" in OUT/gpu_suite.json, so
one call on a GPU tells which goal holds. A goal whose part did not run (not in --parts, failed, or a row missing)
reads "not measured", never "holds". On the CPU (the smoke path) the same rows are computed and say so: those
values tell nothing about a GPU.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Optional

__all__ = ["GOALS", "Goal", "goal_rows", "goals_markdown"]


def _worker_row(result: dict, part: str, mode: str, fused: bool, path: str) -> Optional[dict]:
    """The row of `part`'s worker run (gpu_real_worker.py's "modes") for one mode, fused setting and log-prob path."""
    for row in (result.get(part) or {}).get("modes") or ():
        if row.get("mode") == mode and bool(row.get("fused", False)) == fused and row.get("logprob_path") == path:
            return row
    return None


def _field(row: Optional[dict], key: str) -> Optional[float]:
    value = None if row is None else row.get(key)
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else None


def _rows(result: dict, part: str) -> dict:
    return (result.get(part) or {}).get("rows") or {}


def _worker_ratio(mode: str) -> Callable[[dict], Optional[float]]:
    def read(result: dict) -> Optional[float]:
        return _field(_worker_row(result, "worker", mode, False, "plugin"), "time_vs_binary_tv")

    return read


def _fused_over_unfused_binary(result: dict) -> Optional[float]:
    fused = _field(_worker_row(result, "worker", "dppo_binary_tv", True, "plugin"), "step_seconds")
    unfused = _field(_worker_row(result, "worker", "dppo_binary_tv", False, "plugin"), "step_seconds")
    return fused / unfused if fused is not None and unfused else None


def _topk_reads(result: dict) -> Optional[float]:
    return _field(_rows(result, "per_token").get("topk_divergence, kernels"), "x_one_read")


def _topk_share(result: dict) -> Optional[float]:
    return _field(_rows(result, "per_token").get("topk_divergence, kernels"), "device_share")


def _troll_over_ce(result: dict) -> Optional[float]:
    return _field(_rows(result, "per_token").get("fwd+bwd TROLL, kernels"), "x_torch_ce")


def _fused_troll_ratio(result: dict) -> Optional[float]:
    return _field(_rows(result, "fused").get("fused_troll"), "x_fused_binary")


def _fused_troll_share(result: dict) -> Optional[float]:
    return _field(_rows(result, "fused").get("fused_troll"), "device_share")


def _r3_ratio(result: dict) -> Optional[float]:
    return _field(_worker_row(result, "r3_worker", "dppo_binary_tv", False, "r3"), "time_vs_without_r3")


@dataclass(frozen=True)
class Goal:
    issue: int
    measure: str
    bound: float
    at_most: bool
    """True: the value must be at most `bound`; False: at least."""
    read: Callable[[dict], Optional[float]]

    def holds(self, value: Optional[float]) -> Optional[bool]:
        if value is None:
            return None
        return value <= self.bound if self.at_most else value >= self.bound


GOALS: tuple[Goal, ...] = (
    Goal(75, "worker step, unfused: dppo_topk_tv / dppo_binary_tv", 1.05, True, _worker_ratio("dppo_topk_tv")),
    Goal(75, "worker step, unfused: troll / dppo_binary_tv", 1.05, True, _worker_ratio("troll")),
    Goal(75, "worker step, dppo_binary_tv: fused / unfused", 1.0, True, _fused_over_unfused_binary),
    Goal(75, "topk_divergence: wall time in reads of the logits", 2.0, True, _topk_reads),
    Goal(75, "topk_divergence: device share", 0.9, False, _topk_share),
    Goal(75, "TROLL fwd + bwd, kernels / torch's cross entropy fwd + bwd", 1.5, True, _troll_over_ce),
    Goal(75, "fused TROLL step / verl's fused step (H = 1,024)", 0.5, True, _fused_troll_ratio),
    Goal(75, "fused TROLL step: device share", 0.85, False, _fused_troll_share),
    Goal(72, "worker step, dppo_binary_tv: with R3 / without (Qwen3-MoE layer shape)", 1.05, True, _r3_ratio),
)
"""Issue 75's table (its right column) and issue 72's GPU step-time goal, with where each value sits in the result."""


def goal_rows(result: dict) -> list[dict[str, Any]]:
    """One row per goal: the measure, the bound, the value read from `result` (None: not measured), and whether it
    holds (None: not measured)."""
    rows = []
    for goal in GOALS:
        value = goal.read(result)
        rows.append(
            {
                "issue": goal.issue,
                "measure": goal.measure,
                "goal": f"{'<=' if goal.at_most else '>='} {goal.bound:g}",
                "value": value,
                "holds": goal.holds(value),
            }
        )
    return rows


def goals_markdown(result: dict, rows: list[dict[str, Any]]) -> list[str]:
    """The goals table, for the top of gpu_suite.md."""
    held = sum(row["holds"] is True for row in rows)
    measured = sum(row["holds"] is not None for row in rows)
    lines = [
        f"## Goals on {result.get('device', '?')}: {held} of {measured} measured hold ({len(rows)} goals)",
        "",
    ]
    if result.get("device") == "CPU":
        lines += ["On the CPU (the smoke path): these values say nothing about a GPU.", ""]
    lines += ["| issue | measure | goal | measured | holds |", "|---|---|---|---|---|"]
    for row in rows:
        value = "not measured" if row["value"] is None else f"{row['value']:.3f}"
        holds = {True: "yes", False: "**no**", None: "-"}[row["holds"]]
        lines.append(f"| {row['issue']} | {row['measure']} | {row['goal']} | {value} | {holds} |")
    return lines + [""]
