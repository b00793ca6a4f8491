"""Where a `verl-dppo run`'s JSONL log lands, and how `verl-dppo plot` finds it again.

verl's file logger (verl/utils/tracking.py, `FileLogger`) writes `$VERL_FILE_LOGGER_PATH` if that is set, else
`$VERL_FILE_LOGGER_ROOT/<trainer.project_name>/<trainer.experiment_name>.jsonl`, the root defaulting to "." - the
working directory of the Ray actor that runs the trainer, which the user never chose. `run` pins the root under
`dppo.root` (`$DPPO_ROOT/logs`) by handing the variable to every Ray actor through
`ray_kwargs.ray_init.runtime_env.env_vars`, which verl merges into `ray.init`'s runtime_env: a local Ray and an
existing cluster alike, and the dry run's YAML carries it for a plain `main_ppo` launch too.
"""

from __future__ import annotations

import glob
import json
import os
from typing import Any, Optional

from verl_dppo.errors import UsageError

ROOT_VARIABLE = "VERL_FILE_LOGGER_ROOT"
RECIPE_LOG_ROOT = "${oc.env:" + ROOT_VARIABLE + ",${dppo.root}/logs}"
"""A root set in the launching shell wins; otherwise logs/ under the recipes' one root variable."""


def pin_file_logger(config: Any) -> None:
    """Set VERL_FILE_LOGGER_ROOT for the trainer's Ray actors, unless the user's overrides already set it."""
    from omegaconf import open_dict

    runtime_env = config.ray_kwargs.ray_init.runtime_env
    with open_dict(runtime_env):
        if runtime_env.get("env_vars") is None:
            runtime_env.env_vars = {}
        with open_dict(runtime_env.env_vars):
            if ROOT_VARIABLE not in runtime_env.env_vars:
                runtime_env.env_vars[ROOT_VARIABLE] = RECIPE_LOG_ROOT


def default_log_root() -> str:
    """The folder `run` logs into, as recipes/dppo.yaml resolves it: $VERL_FILE_LOGGER_ROOT, else
    $DPPO_ROOT/logs, else ~/dppo/logs."""
    if os.environ.get(ROOT_VARIABLE):
        return os.path.expanduser(os.environ[ROOT_VARIABLE])
    root = os.environ.get("DPPO_ROOT") or os.path.join(os.path.expanduser("~"), "dppo")
    return os.path.join(os.path.expanduser(root), "logs")


DEMO_OUT = os.path.join("out", "demo")
"""`verl-dppo demo`'s default --out (what `make demo` writes), relative to where it ran: `plot --latest` also
looks there, so that the demo just run is found without naming it."""


def logs_in(folder: str) -> list[str]:
    """The verl logs in a folder: its own `*.jsonl` (a demo's `out/demo`, one file per method) and one level down
    (a log root: `<project>/<experiment>.jsonl`)."""
    pattern = glob.escape(folder)
    return sorted(glob.glob(os.path.join(pattern, "*.jsonl")) + glob.glob(os.path.join(pattern, "*", "*.jsonl")))


def find_log(name: str, root: Optional[str] = None) -> Optional[str]:
    """A run's log from its experiment name (`dense_8b-dppo_binary_tv`, or `PROJECT/EXPERIMENT`) under the log
    root; None if there is none. Raises ValueError if the name matches runs of several projects."""
    root = root or default_log_root()
    stem = name[: -len(".jsonl")] if name.endswith(".jsonl") else name
    if "/" in stem:
        path = os.path.join(root, stem + ".jsonl")
        return path if os.path.isfile(path) else None
    matches = [path for path in logs_in(root) if os.path.basename(path) == stem + ".jsonl"]
    if len(matches) > 1:
        runs = ", ".join(os.path.relpath(path, root)[: -len(".jsonl")] for path in matches)
        raise ValueError(f"{name!r} names runs of several projects under {root}: give one of {runs}")
    return matches[0] if matches else None


def latest_log(root: Optional[str] = None) -> Optional[str]:
    """The most recently written log under the log root."""
    logs = logs_in(root or default_log_root())
    return max(logs, key=os.path.getmtime) if logs else None


def latest_run(root: Optional[str] = None) -> tuple[list[str], Optional[str]]:
    """What `plot --latest` draws: ([the newest log under the root], None), or, when the demo in ./out/demo wrote
    more recently (or the root holds none), (every method's log of that demo, a note saying so). ([], None) when
    neither has a log. With an explicit root (`--log-root`) only that root counts."""
    newest = latest_log(root)
    if root is None:
        demo = logs_in(DEMO_OUT)
        if demo and (newest is None or max(map(os.path.getmtime, demo)) > os.path.getmtime(newest)):
            where = f"nothing under {default_log_root()}" if newest is None else f"newer than {newest}"
            return demo, f"--latest: the demo in {DEMO_OUT} ({len(demo)} runs; {where})"
    return ([newest] if newest else []), None


def known_runs(root: Optional[str] = None, limit: int = 8) -> str:
    """`project/experiment, ...` of the runs under the root (newest first), for an error message."""
    root = root or default_log_root()
    logs = sorted(logs_in(root), key=os.path.getmtime, reverse=True)
    names = [os.path.relpath(path, root)[: -len(".jsonl")] for path in logs]
    if not names:
        return f"no run has logged under {root} yet"
    return f"runs under {root}: " + ", ".join(names[:limit]) + (" ..." if len(names) > limit else "")


class PlotError(UsageError):
    """A problem with the user's input: reported as one line, never as a traceback."""


def _number(value) -> Optional[float]:
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, (int, float)):
        return float(value)
    return None  # strings, lists, null: not plottable


def read_log(path: str) -> tuple[dict[str, dict[int, float]], list[str]]:
    """Read one verl file-logger JSONL: (metric -> {step: value}, warnings). A later row for the same step overrides
    an earlier one, as in a resumed run. Raises PlotError for a file that cannot be a verl log."""
    if not os.path.exists(path):
        raise PlotError(f"{path}: no such file")
    if os.path.isdir(path):
        raise PlotError(f"{path}: is a directory; pass the run's .jsonl file")
    series: dict[str, dict[int, float]] = {}
    warnings: list[str] = []
    try:
        with open(path, "rb") as handle:
            lines = handle.read().decode("utf-8", errors="replace").splitlines()
    except OSError as error:
        raise PlotError(f"{path}: cannot read it ({error.strerror})") from None
    numbered = [(number, line.strip()) for number, line in enumerate(lines, start=1) if line.strip()]
    if not numbered:
        raise PlotError(f"{path}: the file is empty (a run that has not logged a step yet?)")
    bad_lines = []
    for position, (number, line) in enumerate(numbered):
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            # A half-written last row starts like one; anything else (plain text, a CSV) is simply not a row.
            if position == len(numbered) - 1 and line.startswith("{"):
                warnings.append(f"{path}: line {number} is cut short (run still writing, or killed); skipped it")
            else:
                bad_lines.append(number)
            continue
        if not (isinstance(row, dict) and "step" in row and isinstance(row.get("data"), dict)):
            bad_lines.append(number)
            continue
        step = _number(row["step"])
        if step is None:
            bad_lines.append(number)
            continue
        for name, value in row["data"].items():
            number_value = _number(value)
            if number_value is not None:
                series.setdefault(name, {})[int(step)] = number_value
    if bad_lines:
        shown = ", ".join(map(str, bad_lines[:5])) + (" ..." if len(bad_lines) > 5 else "")
        message = f'{path}: {len(bad_lines)} line(s) are not verl file-logger rows {{"step": s, "data": {{...}}}}'
        if len(bad_lines) == len(numbered) or not series:
            raise PlotError(
                f'{path}: not a verl log: no line is a verl file-logger row {{"step": s, "data": '
                "{...}} (write one with trainer.logger=['console','file'])"
            )
        warnings.append(f"{message}; skipped lines {shown}")
    if not series:
        if warnings:  # the only row was cut short
            raise PlotError(f"{path}: no complete verl file-logger row yet (the only line is cut short)")
        raise PlotError(f"{path}: no numeric metric in any row")
    return series, warnings
