"""The plugin's logger, and one WARNING line per process for each key: the "in effect" and "fused" lines a user looks
for in a worker's log, and the warnings a setting triggers at every step (verl's workers log at WARN, so these reach
the driver's console).

The logger does not depend on what the host process did to the root logger: verl's vLLM server process imports vLLM's
OpenAI server, whose dependency `model_hosting_container_standards` sets the root logger and its handler to ERROR at
import, and a WARNING there (a weight push cutting a request, a sampling setting that truncates the rows) was dropped.
"verl_dppo" is enabled at WARNING itself, and a handler of its own (stderr, verl's format) prints a record that no
handler of the root logger takes; where the root's handlers do (verl sets WARNING in every process it starts; pytest's
caplog), the record goes there alone, once.
"""

from __future__ import annotations

import logging
from typing import Any, Hashable

__all__ = ["logger", "warn_once"]

logger = logging.getLogger("verl_dppo")


class _WhereRootIsDeaf(logging.Filter):
    """Passes a record that none of the root logger's handlers would print."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not any(record.levelno >= handler.level for handler in logging.getLogger().handlers)


def _own_handler() -> None:
    if any(getattr(handler, "_verl_dppo", False) for handler in logger.handlers):
        return
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.WARNING)  # not the root's level (ERROR in vLLM's server process); a user's is kept
    handler = logging.StreamHandler()  # sys.stderr: Ray forwards a worker's stderr to the driver's console
    handler.setFormatter(logging.Formatter("%(levelname)s:%(asctime)s:%(message)s"))
    handler.addFilter(_WhereRootIsDeaf())
    handler._verl_dppo = True
    logger.addHandler(handler)


_own_handler()

_SEEN: set = set()


def warn_once(key: Hashable, message: str, *args: Any) -> None:
    """`logger.warning(message, *args)` the first time `key` is seen in this process."""
    if key not in _SEEN:
        _SEEN.add(key)
        logger.warning(message, *args)
