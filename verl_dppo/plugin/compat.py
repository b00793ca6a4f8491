"""The verl releases this plugin is tested with. Importing this module registers nothing."""

from __future__ import annotations

import os
from importlib.metadata import PackageNotFoundError, version

SUPPORTED_VERL_VERSIONS = ("0.9.1",)
SUPPORTED_VERL_RANGE = "verl==0.9.1"
ALLOW_UNTESTED_ENV = "VERL_DPPO_ALLOW_UNTESTED_VERL"


def check_verl_version() -> str:
    """The installed verl version; raises when it is outside the tested range (unless explicitly allowed)."""
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
