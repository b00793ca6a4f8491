"""Entry point of the `verl.plugins` group: `import verl` imports this module in every process.

verl logs a plugin's import error only at DEBUG, so a broken install would surface hours later as
"Unsupported loss mode" at the first actor update. Everything here reports at ERROR before re-raising.
"""

from __future__ import annotations

from verl_dppo.plugin.compat import check_verl_version
from verl_dppo.plugin.log_once import logger  # the plugin's logger, visible whatever the process did to the root's


def register_backends() -> None:
    """The JSONL log kept across a resume (verl's file logger). The CPU rehearsal's backends (the `hf` rollout, the
    `ray_store` checkpoint engine, the CPU platform and its patches) register from an entry point of their own,
    `verl_dppo.rehearsal.entry`: nothing here imports the rehearsal."""
    from verl_dppo.patches._import_hook import when_imported
    from verl_dppo.patches.file_logger import patch_file_logger

    when_imported("verl.utils.tracking", patch_file_logger)


def load() -> None:
    """Register the loss modes, the backends and install the patches (`verl_dppo.patches`).

    The loss modes go into verl's registry the moment verl imports it (`verl.trainer.ppo.core_algos`), not at
    `import verl`: nothing can look a mode up before that, and the processes of a run that never train (the rollout
    router, the reward workers, the rollout server) are spared importing verl's trainer modules (seconds of a
    small CPU each)."""
    check_verl_version()
    from verl_dppo.patches import install
    from verl_dppo.patches._import_hook import when_imported

    when_imported("verl.trainer.ppo.core_algos", _register_losses)
    install()
    register_backends()


def _register_losses(_core_algos) -> None:
    """A failure here fails verl's import of its registry, logged at ERROR by the import hook."""
    import verl_dppo.plugin.losses  # noqa: F401  (registers the modes at its import)


try:
    load()
except Exception:
    logger.exception("verl-dppo failed to load: its loss modes are NOT registered in this process")
    raise
