"""Patch of `verl.utils.tracking.FileLogger`: a resumed run keeps the JSONL lines of the steps before it.

Which verl class: `FileLogger.__init__` opens `<VERL_FILE_LOGGER_ROOT>/<project>/<experiment>.jsonl` with mode "wb",
so a run restarted with `trainer.resume_mode=auto` (after a crash, a preemption, a SIGKILL) truncates the log of
the steps it resumes after: the curve of a long run keeps only its last segment.
What the wrapper does: the file is opened without truncation, and at the first `log(data, step)` of the process
the lines of steps >= that step are dropped (rewritten in place), then lines are appended. A fresh run (first
step 1) thus still starts an empty log, as in verl; a run resumed at step s keeps steps 1..s-1 and loses only lines
a killed run wrote after its last checkpoint (which the resumed run logs again).
Why no extension point: the open mode is hard-coded and the logger does not know the resume step.
What would retire it: verl opening the file in append mode when the trainer resumes from a checkpoint (and
trimming the steps it will log again).
"""

from __future__ import annotations

import os
from typing import Any

from verl_dppo.patches._import_hook import patch_once

__all__ = ["patch_file_logger", "keep_steps_before"]


def keep_steps_before(path: str, step: int) -> int:
    """Rewrite the JSONL file at `path` keeping the lines whose step is < `step`; returns how many were kept."""
    import orjson

    if not os.path.exists(path):
        return 0
    kept = []
    with open(path, "rb") as handle:
        for line in handle:
            try:
                record = orjson.loads(line)
            except orjson.JSONDecodeError:
                continue  # a line cut short by a kill
            if isinstance(record, dict) and isinstance(record.get("step"), int) and record["step"] < step:
                kept.append(line if line.endswith(b"\n") else line + b"\n")
    with open(path, "wb") as handle:
        handle.writelines(kept)
    return len(kept)


def patch_file_logger(module: Any) -> None:
    def make_init(original_init):
        def __init__(self, project_name, experiment_name):
            real_open = open

            def no_truncate(path, mode="r", *args, **kwargs):
                if mode == "wb":
                    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
                    mode = "ab"  # verl's "wb" would truncate the steps a resumed run keeps
                return real_open(path, mode, *args, **kwargs)

            module.open = no_truncate  # module-level name lookup: only FileLogger.__init__ opens files in tracking
            try:
                original_init(self, project_name, experiment_name)
            finally:
                del module.open
            self._verl_dppo_trimmed = False

        return __init__

    def make_log(original_log):
        def log(self, data, step):
            if not getattr(self, "_verl_dppo_trimmed", True):
                self.fp.close()
                keep_steps_before(self.filepath, int(step))
                self.fp = open(self.filepath, "ab", buffering=0)
                self._verl_dppo_trimmed = True
            return original_log(self, data, step)

        return log

    patch_once(module.FileLogger, "__init__", make_init)
    patch_once(module.FileLogger, "log", make_log)
