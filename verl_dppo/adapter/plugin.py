"""Entry point of the `verl.plugins` group: `import verl` imports this module in every process.

verl logs a plugin's import error only at DEBUG, so a broken install would surface hours later as
"Unsupported loss mode" at the first actor update. Everything here reports at ERROR before re-raising.
"""

from __future__ import annotations

import logging
import os
from importlib.metadata import PackageNotFoundError, version

logger = logging.getLogger("verl_dppo")

SUPPORTED_VERL_VERSIONS = ("0.9.1",)
SUPPORTED_VERL_RANGE = "verl==0.9.1"
ALLOW_UNTESTED_ENV = "VERL_DPPO_ALLOW_UNTESTED_VERL"


def check_verl_version() -> str:
    try:
        found = version("verl")
    except PackageNotFoundError as error:
        raise RuntimeError(f"verl-dppo needs {SUPPORTED_VERL_RANGE}, but verl is not installed") from error
    if found not in SUPPORTED_VERL_VERSIONS and os.environ.get(ALLOW_UNTESTED_ENV, "") != "1":
        raise RuntimeError(
            f"verl-dppo is tested with {SUPPORTED_VERL_RANGE} and found verl {found}: it hooks verl internals "
            f"that change between releases, so it refuses to load. Install {SUPPORTED_VERL_RANGE}, or set "
            f"{ALLOW_UNTESTED_ENV}=1 to try anyway."
        )
    return found


def load() -> list[str]:
    """Register the loss modes and install the anchoring hook; returns the registered mode names."""
    check_verl_version()
    from verl_dppo.adapter.anchoring import install
    from verl_dppo.adapter.losses import register_all

    modes = register_all()
    install()
    return modes


try:
    REGISTERED_MODES = load()
except Exception:
    logger.exception("verl-dppo failed to load: its loss modes are NOT registered in this process")
    raise
