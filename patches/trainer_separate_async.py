"""Patch of `verl.trainer.ppo.v1.trainer_separate_async`'s module logger: `actor_rollout_ref.hybrid_engine=False` runs.

Which verl line: `PPOTrainerSeparateAsync._setup` (verl 0.9.1, trainer_separate_async.py:181), where the hybrid
replicas are off (`actor_rollout_ref.hybrid_engine=False`: the rollout served by the standalone pool alone), calls
`logger.info(..., flush=True)`; `logging.Logger` takes no `flush`, so every such run died at start with "TypeError:
Logger._log() got an unexpected keyword argument 'flush'", whatever the log level.
What the wrapper does: the module's `logger` becomes an adapter of the same logger that drops a `flush` argument;
every other call goes through unchanged.
Why no extension point: the call is in the trainer's own setup.
What would retire it: verl dropping `flush=True` from that `logger.info` call.
"""

from __future__ import annotations

import logging
from typing import Any

__all__ = ["FlushTolerantLogger", "patch_separate_async_logger"]


class FlushTolerantLogger(logging.LoggerAdapter):
    """A logger that ignores print()'s `flush` argument (a logging handler flushes each record itself)."""

    def log(self, level: int, msg: Any, *args: Any, **kwargs: Any) -> None:
        kwargs.pop("flush", None)
        super().log(level, msg, *args, **kwargs)


def patch_separate_async_logger(module: Any) -> None:
    if not isinstance(module.logger, FlushTolerantLogger):
        module.logger = FlushTolerantLogger(module.logger, {})
