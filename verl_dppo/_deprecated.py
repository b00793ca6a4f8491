"""Old import paths (before the 0.2 layout) keep working for one release, with a DeprecationWarning."""

from __future__ import annotations

import warnings


def moved(old: str, new: str) -> None:
    warnings.warn(f"{old} moved to {new}; the old path will be removed in the next release", DeprecationWarning,
                  stacklevel=3)
