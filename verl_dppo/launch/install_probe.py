"""What `import verl` alone gives a process: the plugin's loss modes in verl's registry, the anchoring hook, and
which rollout engines it could start. Run by `verl-dppo doctor` in its own process and, through
`verl_dppo.launch.ray_probe`, inside a Ray worker (both import this module, neither imports the other's command)."""

from __future__ import annotations

import importlib.util
import os
from importlib.metadata import PackageNotFoundError, version
from typing import Optional

ROLLOUT_ENGINES = ("vllm", "sglang")
"""verl 0.9.1's rollout engines for RL runs; every recipe needs one (`actor_rollout_ref.rollout.name`)."""


def version_of(package: str) -> Optional[str]:
    try:
        return version(package)
    except PackageNotFoundError:
        return None


def engines_here() -> dict[str, Optional[str]]:
    """engine -> its version where it is importable here, else None. Found without importing it: importing vLLM
    takes seconds and may initialise CUDA."""
    return {
        engine: (version_of(engine) or "?") if importlib.util.find_spec(engine) else None for engine in ROLLOUT_ENGINES
    }


TRAINER_MODULES = {
    "transfer_queue": "TransferQueue",
    "ray": "ray",
    "fastapi": "fastapi",
    "uvicorn": "uvicorn",
    "zmq": "pyzmq",
    "msgspec": "msgspec",
    "cachetools": "cachetools",
}
"""Module -> package: what verl 0.9.1's trainer, workers and agent loop import at run time without requiring it
(setup.py's install_requires brings each)."""


def missing_trainer_modules() -> list[str]:
    """The packages of TRAINER_MODULES whose module is not importable here (found without importing them)."""
    return [package for module, package in TRAINER_MODULES.items() if importlib.util.find_spec(module) is None]


def expected_modes() -> list[str]:
    """The loss modes the plugin registers, read from its own table (`LOSS_MODES`), not a list kept here."""
    from verl_dppo.plugin.losses import LOSS_MODES

    return [mode.name for mode in LOSS_MODES]


def plugin_state() -> dict:
    """This process after `import verl` (exactly what verl's own workers do): the modes verl's registry holds from
    this plugin (tagged `__verl_dppo__` at registration), whether verl's `ppo_loss` is the anchoring wrapper, the
    rollout engines importable here, and the process id."""
    import verl  # noqa: F401  (loads the verl.plugins entry points)
    from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY

    from verl_dppo.patches.workers_utils_losses import is_installed

    return {
        "registered": sorted(name for name, fn in POLICY_LOSS_REGISTRY.items() if getattr(fn, "__verl_dppo__", False)),
        "hook_installed": is_installed(),
        "engines": engines_here(),
        "pid": os.getpid(),
    }
