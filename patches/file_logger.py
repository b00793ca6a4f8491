"""Patch of `verl.utils.tracking.FileLogger`: a resumed run keeps the JSONL lines of the steps before it.

Which verl class: `FileLogger.__init__` opens `<VERL_FILE_LOGGER_ROOT>/<project>/<experiment>.jsonl` with mode "wb",
so a run restarted with `trainer.resume_mode=auto` (after a crash, a preemption, a SIGKILL) truncates the log of
the steps it resumes after: the curve of a long run keeps only its last segment.
What the wrapper does: the file is opened without truncation, and at the first `log(data, step)` of the process
the lines the run will log again are dropped (rewritten in place), then lines are appended. Which lines: a run
resumed from the checkpoint of step s logs its training steps from s + 1, after a validation record at step s when
`trainer.val_before_train=True` (verl's v1 `fit`: validation at `global_steps`, the checkpoint's step). So a first
record of training metrics at step t drops the lines of steps >= t; a first record that is validation only (every
key `val-*`) at step s drops the lines of steps > s and the validation-only lines of step s, keeping step s's
training record. A fresh run (first record at step 1, or its validation at step 0) thus still starts an empty
log, as in verl; a resumed one loses only the lines a killed run wrote after its last checkpoint (which the resumed
run logs again).
Why no extension point: the open mode is hard-coded and the logger does not know the resume step.
What would retire it: verl opening the file in append mode when the trainer resumes from a checkpoint (and
trimming the steps it will log again).
"""

from __future__ import annotations

import os
from typing import Any

from verl_dppo.patches._import_hook import patch_once

__all__ = ["patch_file_logger", "keep_steps_before", "is_validation_record"]


def is_validation_record(data: Any) -> bool:
    """Whether a record holds validation metrics only (verl's `val-core/*`, `val-aux/*`)."""
    return isinstance(data, dict) and bool(data) and all(str(key).startswith("val-") for key in data)


def keep_steps_before(path: str, step: int, validation: bool = False) -> int:
    """Rewrite the JSONL file at `path` for a run whose first record is at `step`: keep the lines of steps < `step`,
    and with `validation` (that first record is a validation at the resumed checkpoint's step) also the lines of
    `step` that are not validation only. Returns how many lines were kept."""
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
            if not (isinstance(record, dict) and isinstance(record.get("step"), int)):
                continue
            at = record["step"]
            if at < step or (validation and at == step and not is_validation_record(record.get("data"))):
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
                keep_steps_before(self.filepath, int(step), validation=is_validation_record(data))
                self.fp = open(self.filepath, "ab", buffering=0)
                self._verl_dppo_trimmed = True
            return original_log(self, data, step)

        return log

    patch_once(module.FileLogger, "__init__", make_init)
    patch_once(module.FileLogger, "log", make_log)
