"""Entry point of the `verl.plugins` group: `import verl` imports this module in every process.

verl logs a plugin's import error only at DEBUG, so a broken install would surface hours later as
"Unsupported loss mode" at the first actor update. Everything here reports at ERROR before re-raising.
"""

from __future__ import annotations

import logging

from verl_dppo.plugin.compat import check_verl_version

logger = logging.getLogger("verl_dppo")


def load() -> list[str]:
    """Register the loss modes and install the patches (`verl_dppo.patches`); returns the registered mode names."""
    check_verl_version()
    from verl_dppo.patches import install
    from verl_dppo.plugin.losses import register_all

    modes = register_all()
    install()
    return modes


try:
    REGISTERED_MODES = load()
except Exception:
    logger.exception("verl-dppo failed to load: its loss modes are NOT registered in this process")
    raise
