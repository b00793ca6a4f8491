"""Patch of `verl.trainer.main_ppo`: the resolved-config dump of `TaskRunner.run`, in a `verl-dppo run` launch only.

Which verl code: `TaskRunner.run` (the TaskRunnerV1 Ray actor) calls the module's `pprint` on the whole resolved
config, about 700 lines before the first step.
What the patch does: where `verl-dppo run` launched the run, it wrote that same config as YAML into a file and named
it in CONFIG_FILE_VARIABLE in the run's Ray environment; the dump then becomes one line naming the file. Every
other `pprint` call, and every run without the variable (`python -m verl.trainer.main_ppo`), is verl's own.
Why no extension point: verl 0.9.1 prints the config unconditionally (no verbosity setting).
What would make it unnecessary: a trainer setting for the config dump (print / file / off).
"""

from __future__ import annotations

import os
from typing import Any

__all__ = ["CONFIG_FILE_VARIABLE", "patch_main_ppo"]

CONFIG_FILE_VARIABLE = "VERL_DPPO_CONFIG_FILE"


def is_run_config(obj: Any) -> bool:
    return isinstance(obj, dict) and "actor_rollout_ref" in obj and "trainer" in obj


def patch_main_ppo(module: Any) -> None:
    original = module.pprint
    if getattr(original, "_verl_dppo", False):
        return

    def pprint(obj, *args, **kwargs):
        path = os.environ.get(CONFIG_FILE_VARIABLE)
        if path and is_run_config(obj):
            print(
                f"verl-dppo: verl's resolved config is in {path} (main_ppo's dump of it, not repeated here)", flush=True
            )
            return None
        return original(obj, *args, **kwargs)

    pprint._verl_dppo = True
    module.pprint = pprint
