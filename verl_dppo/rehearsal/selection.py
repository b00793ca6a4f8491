"""Whether this process runs on the CPU platform: one environment variable, read without importing verl (vLLM's own
processes ask it too, `patches.vllm_shm_broadcast`, where an `import verl` would cost seconds at every engine start)."""

from __future__ import annotations

import os

__all__ = ["PLATFORM_NAME", "is_selected"]

PLATFORM_NAME = "cpu"
"""The value of VERL_PLATFORM that selects this platform."""


def is_selected() -> bool:
    """Whether this process runs verl on the CPU platform (VERL_PLATFORM=cpu)."""
    return os.environ.get("VERL_PLATFORM", "").strip().lower() == PLATFORM_NAME
