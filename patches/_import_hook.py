"""Patch a verl module the moment it is first imported (or now, if it already is).

The plugin loads at `import verl`, before verl's engine, rollout-server and agent-loop modules are imported, and
some of those import vLLM / SGLang / flash-attn, which must never be imported eagerly. A finder on `sys.meta_path`
wraps the module's loader so that `patch(module)` runs right after the module body, once per process.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.util
import logging
import sys
import threading
from typing import Any, Callable

__all__ = ["patch_once", "when_imported"]

_PATCHED = "__verl_dppo_patched__"

logger = logging.getLogger("verl_dppo")

_PENDING: dict[str, list[Callable]] = {}
_LOCK = threading.RLock()


def _run(name: str, module) -> None:
    for patch in _PENDING.pop(name, []):
        try:
            patch(module)
        except Exception:
            logger.exception("verl-dppo: patching %s failed; the plugin cannot run its loss modes correctly", name)
            raise


class _Loader(importlib.abc.Loader):
    def __init__(self, loader, name: str):
        self._loader = loader
        self._name = name

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        with _LOCK:
            _run(self._name, module)

    def __getattr__(self, item):  # get_source, is_package, ... for tools that ask the loader
        return getattr(self._loader, item)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname not in _PENDING:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and not isinstance(spec.loader, _Loader):
                    spec.loader = _Loader(spec.loader, fullname)
                return spec
        return None


_FINDER = _Finder()


def when_imported(name: str, patch: Callable) -> None:
    """Call `patch(module)` once `name` is imported: now if it already is, else right after its first import."""
    with _LOCK:
        module = sys.modules.get(name)
        if module is not None and name not in _PENDING:
            patch(module)
            return
        _PENDING.setdefault(name, []).append(patch)
        if _FINDER not in sys.meta_path:
            sys.meta_path.insert(0, _FINDER)


def patch_once(owner: Any, name: str, make_replacement: Callable[[Callable], Callable]) -> bool:
    """Replace `owner.name` with `make_replacement(original)` (keeping the original's metadata, e.g. verl's
    `@register` attributes), unless it already is a replacement of ours. Returns whether it patched now."""
    original = getattr(owner, name)
    if getattr(original, _PATCHED, False):
        return False
    replacement = functools.wraps(original)(make_replacement(original))
    setattr(replacement, _PATCHED, True)
    setattr(owner, name, replacement)
    return True
