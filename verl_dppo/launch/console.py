"""What `verl-dppo run` prints around verl's own output: less of what is only noise, and a last line that says where
the run's results are.

Cut, in the run's Ray processes only (`python -m verl.trainer.main_ppo` keeps verl's output as it is):
- the resolved config that verl's TaskRunner prints whole (about 700 lines): written to a file beside the run's log
  instead, and the dump replaced by one line naming it (the patch in `verl_dppo.patches.main_ppo`);
- verl's warnings that optional training engines are not installed (torchtitan, veomni, automodel, mindspeed,
  megatron: five per process that imports `verl.workers.engine`, in three processes of a run); `verl-dppo doctor`
  says which engines this environment has; and megatron-core's and mbridge's warnings that TransformerEngine and Apex
  are absent, where megatron-core is installed.
"""

from __future__ import annotations

import os
from typing import Any, Optional

from verl_dppo.patches.main_ppo import CONFIG_FILE_VARIABLE

__all__ = ["ENGINE_WARNINGS_FILTER", "MEGATRON_WARNINGS_FILTERS", "quiet_launch", "summary_line", "steps_logged"]

ENGINE_WARNINGS_FILTER = "ignore::UserWarning:verl.workers.engine"
"""A PYTHONWARNINGS entry: the UserWarnings `verl/workers/engine/__init__.py` raises for each optional engine it
cannot import (that module raises no other)."""
MEGATRON_WARNINGS_FILTERS = ("ignore:Transformer Engine and Apex are not installed", "ignore:Apex is not installed")
"""PYTHONWARNINGS entries (a message's start): megatron-core and mbridge, which verl imports in every process that
imports its engines where they are installed, warn at import that TransformerEngine and Apex are absent (eight
warnings, 16 lines, per process); `verl-dppo doctor` says what Megatron support this environment has."""
CHECKPOINT_CONFIG = "verl_config.yaml"


def config_file(config: Any) -> str:
    """Where the run's resolved config goes: beside its JSONL log (`<experiment>.config.yaml`), else (no file
    logger) into its checkpoint folder."""
    from verl_dppo.launch.run_record import checkpoint_dir, log_path

    log = log_path(config)
    if log:
        return os.path.splitext(log)[0] + ".config.yaml"
    return os.path.join(checkpoint_dir(config), CHECKPOINT_CONFIG)


def quiet_launch(config: Any) -> list[str]:
    """Before the launch, on a resolved config: write it to `config_file`, name that file in the run's Ray
    environment for the main_ppo patch, and filter the engine warnings there. Returns problems for a warning (a
    config that cannot be written is then printed whole, as verl does)."""
    from omegaconf import open_dict

    from verl_dppo.launch.compose import resolved_yaml

    runtime_env = config.ray_kwargs.ray_init.runtime_env
    with open_dict(runtime_env):
        if runtime_env.get("env_vars") is None:
            runtime_env.env_vars = {}
    env_vars = runtime_env.env_vars
    problems = []
    path = config_file(config)
    with open_dict(env_vars):
        current = (env_vars.get("PYTHONWARNINGS") or os.environ.get("PYTHONWARNINGS") or "").split(",")
        added = [entry for entry in (ENGINE_WARNINGS_FILTER, *MEGATRON_WARNINGS_FILTERS) if entry not in current]
        if added:
            env_vars["PYTHONWARNINGS"] = ",".join(filter(None, [*current, *added]))
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w") as handle:
                handle.write(resolved_yaml(config))
            env_vars[CONFIG_FILE_VARIABLE] = path
        except OSError as error:
            problems.append(f"cannot write the run's config to {path} ({error.strerror or error}): verl prints it")
    return problems


def steps_logged(log: Optional[str]) -> Optional[int]:
    """The last training step in a verl file-logger JSONL (validation-only rows do not count), or None."""
    from verl_dppo.launch.run_logs import PlotError, read_log

    if not log or not os.path.exists(log):
        return None
    try:
        steps = read_log(log)[0].get("training/global_step")
    except PlotError:
        return None
    return max(steps) if steps else None


def summary_line(config: Any) -> str:
    """The launch's last line: steps done, where the log, the checkpoints, the config and the run record are, and
    the command that draws the log."""
    from verl_dppo.launch.run_record import CHECKPOINT_RECORD, checkpoint_dir, log_path

    log = log_path(config)
    steps = steps_logged(log)
    total = int(config.trainer.total_training_steps or 0)
    done = f"{steps} of {total} steps" if steps is not None and total else f"{total} steps"
    checkpoints = checkpoint_dir(config)
    parts = [f"verl-dppo: done, {done} of {config.dppo.setup} + {config.dppo.get('run_label', config.dppo.method)}"]
    if log:
        parts.append(f"log {log}")
    parts.append(f"checkpoints {checkpoints}")
    parts.append(f"config {config_file(config)}")
    parts.append(f"run record {os.path.join(checkpoints, CHECKPOINT_RECORD)}")
    if log:
        figure = os.path.basename(os.path.splitext(log)[0]) + ".png"
        parts.append(f"draw it: verl-dppo plot {log} -o {figure}")
    return "; ".join(parts)
