"""Which run a checkpoint folder and a JSONL log belong to, so that `verl-dppo run` can warn before a launch
resumes or overwrites another method's run.

verl keys both on `trainer.experiment_name`: the checkpoints in `trainer.default_local_dir` (the recipes:
`$DPPO_ROOT/checkpoints/<project>/<experiment>`), which `resume_mode=auto` resumes from whatever wrote them
(`find_latest_ckpt_path`: the step in `latest_checkpointed_iteration.txt`), and the file logger's
`<root>/<project>/<experiment>.jsonl`, which verl opens with "wb" at every start. Neither records the loss
mode. So at each launch `run` writes a small record, `verl_dppo_run.json`, into the checkpoint folder and
`<experiment>.run.json` beside the log, and the next launch under the same names reads them back.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any, Optional

from verl_dppo.launch.run_logs import ROOT_VARIABLE

CHECKPOINT_RECORD = "verl_dppo_run.json"
IDENTITY = ("setup", "method", "loss_mode", "trainer_mode")
"""What makes two launches the same run: a rerun with the same four resumes it, as verl's resume_mode=auto
intends; a different loss mode under the same recipe method (the README's verl-`dppo_tv` comparison) is not, nor
the same recipe under another trainer mode (a sync checkpoint resumed by an async trainer)."""
RECORDED_BEFORE = {"trainer_mode": "sync"}
"""Records written before a key was recorded: what those launches ran (every launch was sync then)."""


def identity(config: Any) -> dict[str, str]:
    return {
        "setup": str(config.dppo.setup),
        "method": str(config.dppo.method),
        "loss_mode": str(config.actor_rollout_ref.actor.policy_loss.loss_mode),
        "trainer_mode": str(config.dppo.get("trainer_mode", "sync")),
    }


def _same_run(record: Optional[dict], me: dict[str, str]) -> bool:
    return record is not None and all(record.get(key, RECORDED_BEFORE.get(key)) == me[key] for key in IDENTITY)


def checkpoint_dir(config: Any) -> str:
    return os.path.abspath(os.path.expanduser(str(config.trainer.default_local_dir)))


def log_path(config: Any) -> Optional[str]:
    """The JSONL file verl's FileLogger will write for this config (None without the file logger), as verl's
    `FileLogger.__init__` computes it from the trainer actor's environment: `run`'s runtime_env, else this shell."""
    loggers = config.trainer.get("logger") or []
    if "file" not in ([loggers] if isinstance(loggers, str) else list(loggers)):
        return None
    env_vars = (config.get("ray_kwargs", {}).get("ray_init", {}).get("runtime_env", {}) or {}).get("env_vars") or {}
    path = env_vars.get("VERL_FILE_LOGGER_PATH") or os.environ.get("VERL_FILE_LOGGER_PATH")
    if path:
        return os.path.abspath(os.path.expanduser(str(path)))
    root = env_vars.get(ROOT_VARIABLE) or os.environ.get(ROOT_VARIABLE) or "."
    return os.path.abspath(
        os.path.join(
            os.path.expanduser(str(root)), str(config.trainer.project_name), f"{config.trainer.experiment_name}.jsonl"
        )
    )


def _log_record(log: str) -> str:
    return os.path.splitext(log)[0] + ".run.json"


def write_records(config: Any, command: Optional[str] = None) -> list[str]:
    """Record this launch's identity (and its `verl-dppo run` command line, where given) beside its checkpoints and
    its log. Returns the problems (one line each) for a warning: a record that cannot be written only weakens the
    next launch's check."""
    record = {
        **identity(config),
        "experiment_name": str(config.trainer.experiment_name),
        "written": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "by": "verl-dppo run",
    }
    if command:
        record["command"] = command
    targets = [os.path.join(checkpoint_dir(config), CHECKPOINT_RECORD)]
    log = log_path(config)
    if log:
        targets.append(_log_record(log))
    problems = []
    for target in targets:
        try:
            os.makedirs(os.path.dirname(target), exist_ok=True)
            with open(target, "w") as handle:
                json.dump(record, handle, indent=1)
        except OSError as error:
            problems.append(f"cannot record this run in {target} ({error.strerror or error})")
    return problems


def _read(path: str) -> Optional[dict]:
    try:
        with open(path) as handle:
            record = json.load(handle)
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def _resumable_step(folder: str) -> Optional[int]:
    """The step verl's resume_mode=auto would resume from in `folder` (verl's own find_latest_ckpt_path rule: the
    tracker file names a step whose global_step_N folder exists), or None."""
    try:
        with open(os.path.join(folder, "latest_checkpointed_iteration.txt")) as handle:
            step = int(handle.read().strip())
    except (OSError, ValueError):
        return None
    return step if os.path.isdir(os.path.join(folder, f"global_step_{step}")) else None


def _who(record: Optional[dict]) -> str:
    if record is None:
        return "a run whose method is not recorded (not launched by `verl-dppo run`)"
    mode = record.get("trainer_mode", RECORDED_BEFORE["trainer_mode"])
    return (
        f"{record.get('setup')} --method {record.get('method')} --trainer-mode {mode} "
        f"(loss_mode {record.get('loss_mode')})"
    )


def clash_warning(config: Any) -> Optional[str]:
    """One line when this launch would resume (resume_mode=auto) a run of another setup, method, loss mode or trainer
    mode, or write into its JSONL log (continue it after the resumed step, or overwrite it when nothing is resumed),
    naming it and what to change; None otherwise, a same-run resume included."""
    me = identity(config)
    clauses, others = [], []
    folder = checkpoint_dir(config)
    step = _resumable_step(folder) if str(config.trainer.get("resume_mode", "auto")) == "auto" else None
    if step is not None:
        record = _read(os.path.join(folder, CHECKPOINT_RECORD))
        if not _same_run(record, me):
            clauses.append(f"resume step {step} of {_who(record)} from {folder}")
            others.append(record)
    log = log_path(config)
    if log and os.path.isfile(log) and os.path.getsize(log) > 0:
        record = _read(_log_record(log))
        if not _same_run(record, me):
            owner = "its" if clauses and record == others[0] else f"the log of {_who(record)},"
            # the plugin's FileLogger: a resumed run keeps the lines up to its checkpoint, a fresh one starts anew
            clauses.append(
                f"continue {owner} {log} after step {step}" if step is not None else f"overwrite {owner} {log}"
            )
    if not clauses:
        return None
    return (
        f"this launch ({me['setup']} --method {me['method']} --trainer-mode {me['trainer_mode']}, loss_mode "
        f"{me['loss_mode']}) would "
        f"{' and '.join(clauses)}: give it its own trainer.experiment_name=NAME"
    )
