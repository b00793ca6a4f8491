"""vLLM's CPU build (`vllm-cpu` on the package registry) as verl's `vllm` rollout, installed beside verl.

`vllm-cpu` 0.27.1 is a community CPU build of vLLM (github MekayelAnik/vllm-cpu): the `vllm` package, installed as
the distribution `vllm-cpu`. verl 0.9.1 asks `importlib.metadata` for the distribution named `vllm` when it imports
its vLLM rollout (verl/third_party/vllm/__init__.py:30-31, workers/rollout/vllm_rollout/__init__.py:27-28,
utils/vllm/vllm_quant_utils.py:67) and would report "vllm version None not supported". `alias()` adds the
metadata of a distribution `vllm` with vllm-cpu's version and the local label `+cpu` (vLLM's own platform detection,
vllm/platforms/__init__.py `vllm_version_matches_substr`, reads the same version and looks for "cpu" in it): no
code, only a dist-info folder, listed in its own RECORD so that `pip uninstall vllm` removes it again.

For a `trainer.device=cpu` run with `actor_rollout_ref.rollout.name=vllm`, `vllm_cpu_settings` sets what vLLM needs
on CPU and `vllm_cpu_problems` names what stops it (both called by `verl_dppo.rehearsal.setups.cpu_tiny` at launch).

`python -m verl_dppo.rehearsal.setups.vllm_cpu` runs `alias()` (the Makefile's set-up does, after installing vllm-cpu); it is a no-op
where vLLM is installed as `vllm` (a GPU build) or not at all.

verl 0.9.1 pins vllm 0.24.0; the registry's vllm-cpu 0.24.0-0.26.0 need a torch 2.11.0+cpu it does not have, so
the CPU tier runs vLLM 0.27.1: verl's unmodified vLLM server code against a newer engine (docs say what that proves).
"""

from __future__ import annotations

import json
import os
import sys
from importlib.metadata import PackageNotFoundError, distribution
from pathlib import Path
from typing import Any, Optional

__all__ = [
    "CPU_DISTRIBUTION",
    "VLLM_CPU_HEAD_SIZES",
    "alias",
    "cpu_build_version",
    "needs_alias",
    "vllm_cpu_problems",
    "vllm_cpu_settings",
]

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
        "METADATA": (
            f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n"
            f"Summary: metadata only: the vllm package of {CPU_DISTRIBUTION} {cpu_version}, under the name "
            "verl looks up (written by verl-dppo)\n"
        ),
        "INSTALLER": "verl-dppo\n",
    }
    for name, text in files.items():
        (folder / name).write_text(text)
    record = [f"{folder.name}/{name},," for name in (*files, "RECORD")]
    (folder / "RECORD").write_text("\n".join(record) + "\n")
    return folder


# ------------------------------------------------------------------------------ a CPU run with the vllm rollout

VLLM_CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
"""What vLLM-CPU's attention accepts (vllm v1/attention/backends/cpu_attn.py `get_supported_head_sizes`, 0.27.1)."""
VLLM_CPU_SETTINGS = {"enforce_eager": True, "enable_sleep_mode": False, "free_cache_engine": False}
"""actor_rollout_ref.rollout.* a vLLM rollout needs on CPU: no CUDA graphs to capture, and vLLM refuses its sleep
mode there (vllm config/model.py: "Sleep mode is not supported on current platform"), so the KV cache stays."""
VLLM_CPU_BUCKET_MB = 64
"""verl's checkpoint engine stages each weight bucket in a /dev/shm segment of this size where IPC is not available
(vllm_rollout.py:143): verl's default, 2048, would take 2 GiB of a small machine's shared memory. A bucket holds
whole tensors: a setup whose largest tensor is bigger names its own size in `dppo.vllm_cpu_bucket_mb` (smollm2:
its float32 embedding is 113 MB)."""


def vllm_cpu_settings(config: Any) -> None:
    """A `trainer.device=cpu` run with `actor_rollout_ref.rollout.name=vllm` (vLLM's CPU build): the settings vLLM
    needs there (VLLM_CPU_SETTINGS, a weight bucket of at most VLLM_CPU_BUCKET_MB or the setup's
    `dppo.vllm_cpu_bucket_mb`), and the rollout's name in a
    cpu_tiny run's experiment name (`dppo.rollout_suffix`), so that it never resumes an `hf` run's checkpoint."""
    from omegaconf import open_dict

    rollout = config.actor_rollout_ref.rollout
    with open_dict(rollout):
        for key, value in VLLM_CPU_SETTINGS.items():
            rollout[key] = value
        engine = rollout.get("checkpoint_engine")
        if engine is not None:
            cap = int(config.get("dppo", {}).get("vllm_cpu_bucket_mb") or VLLM_CPU_BUCKET_MB)
            with open_dict(engine):
                engine.update_weights_bucket_megabytes = min(
                    int(engine.get("update_weights_bucket_megabytes") or cap), cap
                )


def vllm_cpu_problems(config: Any) -> list[str]:
    """What stops `actor_rollout_ref.rollout.name=vllm` on CPU: no vLLM CPU build here, or a model vLLM-CPU's
    attention refuses (a cpu_tiny model that is not built yet is checked by its settings)."""
    import importlib.util

    if cpu_build_version() is None:
        found = "a GPU build of vLLM" if importlib.util.find_spec("vllm") else "no vLLM"
        return [
            f"actor_rollout_ref.rollout.name=vllm on CPU (trainer.device=cpu) needs vLLM's CPU build, vllm-cpu "
            f"0.27.1, and this environment has {found}: run `make venv` in the verl-dppo checkout (it installs "
            f"vllm-cpu), or use actor_rollout_ref.rollout.name=hf"
        ]
    if needs_alias():
        return [
            "vllm-cpu is installed but verl cannot see it (verl looks up the distribution `vllm`): run "
            "`python -m verl_dppo.rehearsal.setups.vllm_cpu` once in this environment (`make venv` does)"
        ]
    head_dim = _head_dim(config)
    if head_dim is not None and head_dim not in VLLM_CPU_HEAD_SIZES:
        return [
            f"the model's head_dim is {head_dim}, which vLLM's CPU attention does not support (it takes "
            f"{', '.join(map(str, VLLM_CPU_HEAD_SIZES))}): for cpu_tiny set dppo.tiny_model.head_dim=32, or use "
            f"actor_rollout_ref.rollout.name=hf"
        ]
    return []


def _head_dim(config: Any) -> Optional[int]:
    """The head size of the run's model: cpu_tiny's from its settings, another from its config.json (None: unknown)."""
    tiny = config.get("dppo", {}).get("tiny_model")
    if tiny is not None and _path(config.actor_rollout_ref.model.path) == _path(tiny.path):
        return int(tiny.head_dim)
    try:
        model = json.loads((_path(config.actor_rollout_ref.model.path) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if model.get("head_dim"):
        return int(model["head_dim"])
    if model.get("hidden_size") and model.get("num_attention_heads"):
        return int(model["hidden_size"]) // int(model["num_attention_heads"])
    return None


def _path(value: Any) -> Path:
    return Path(os.path.expanduser(str(value))).resolve()


def main() -> int:
    folder = alias()
    if folder is not None:
        print(f"verl-dppo: {CPU_DISTRIBUTION} {cpu_build_version()} is verl's vllm rollout here ({folder.name})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
