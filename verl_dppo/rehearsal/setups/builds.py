"""A folder built once and renamed into place: the cpu_tiny model and data (cpu_tiny.py) and the real model's
checkpoint (real_model.py) are written this way."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable, Optional

from verl_dppo.errors import UsageError

__all__ = ["built", "build_once"]


def built(target: Path, manifest: dict, manifest_file: str) -> bool:
    """Whether `target` holds a finished build with this manifest."""
    try:
        return json.loads((target / manifest_file).read_text()) == manifest
    except (OSError, ValueError):
        return False


def build_once(
    target: Path, manifest: dict, write: Callable[[Path], Any], manifest_file: str, what: str, error: type = UsageError
) -> Optional[Any]:
    """Write the folder `target` with `write(tmp)` unless a build with the same manifest (in `target/manifest_file`)
    is there; returns what `write` returned, None if nothing was built. A finished build is renamed into place, so a
    concurrent run sees none or a whole one; an older build (other settings) is replaced; a folder that is not a
    build is refused with `error` (the message calls a build `what`), never replaced."""
    if built(target, manifest, manifest_file):
        return None
    if target.exists() and not (target / manifest_file).is_file():
        raise error(f"{target} exists and is not a {what}: move it away, or set DPPO_ROOT elsewhere")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        result = write(tmp)
        (tmp / manifest_file).write_text(json.dumps(manifest, indent=1, sort_keys=True))
        if built(target, manifest, manifest_file):  # a concurrent run finished first
            return None
        if target.exists():
            shutil.rmtree(target)
        try:
            os.rename(tmp, target)
        except OSError:
            if not built(target, manifest, manifest_file):
                raise
            return None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return result
