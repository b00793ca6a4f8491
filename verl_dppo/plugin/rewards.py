"""Reward functions for verl's `custom_reward_function` (verl calls `fn(data_source, solution_str, ground_truth,
extra_info)` in its reward workers), for the setups whose model does not write verl's verifier formats.

`last_number`: 1.0 where the last number in the response equals the ground truth, else 0.0. The smollm2 setup's
SmolLM2-135M-Instruct answers cpu_tiny's word problems in prose ("Ada has 10 marbles now."), rarely after verl's
GSM8K marker ("#### 10"), so verl's strict GSM8K verifier would reward almost nothing; its own flexible mode reads
the last number too (verl.utils.reward_score.gsm8k, `method="flexible"`), which verl's default routing never picks.
"""

from __future__ import annotations

import re
from typing import Any, Optional

__all__ = ["last_number"]

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def _value(text: str) -> Optional[float]:
    try:
        return float(text.replace(",", "").rstrip("."))
    except ValueError:
        return None


def last_number(data_source: str, solution_str: str, ground_truth: Any, extra_info: Any = None, **_: Any) -> float:
    found = _NUMBER.findall(solution_str or "")
    if not found:
        return 0.0
    answer, truth = _value(found[-1]), _value(str(ground_truth))
    return 1.0 if answer is not None and truth is not None and answer == truth else 0.0
