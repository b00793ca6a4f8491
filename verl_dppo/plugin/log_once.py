"""One WARNING line per process for each key: the "in effect" and "fused" lines a user looks for in a worker's log, and
the warnings a setting triggers at every step (verl's workers log at WARN, so these reach the driver's console)."""

from __future__ import annotations

import logging
from typing import Any, Hashable

__all__ = ["warn_once"]

logger = logging.getLogger("verl_dppo")

_SEEN: set = set()


def warn_once(key: Hashable, message: str, *args: Any) -> None:
    """`logger.warning(message, *args)` the first time `key` is seen in this process."""
    if key not in _SEEN:
        _SEEN.add(key)
        logger.warning(message, *args)
