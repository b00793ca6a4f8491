"""Bring your own model and data: `verl-dppo run --config-dir DIR` adds DIR's `setup/` and `method/` folders to the
recipes, the way Hydra's own `--config-dir` adds a folder to the search path.

A user setup is a file like the shipped ones (`# @package _global_`, `dppo.setup: <its name>`); its defaults list
may start from a shipped setup (`- sanity_1p5b`) and change only the model and the data. The folder is appended to
dppo.yaml's `hydra.searchpath`, after the shipped recipes: a user file named like a shipped one would never be
read, so such a name is refused.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from verl_dppo.errors import UsageError

GROUPS = ("setup", "method")


def check_config_dirs(config_dirs: Sequence[str]) -> list[Path]:
    folders = []
    for config_dir in config_dirs:
        folder = Path(config_dir).expanduser().resolve()
        if not folder.is_dir():
            raise UsageError(f"--config-dir {config_dir}: no such folder")
        if not any((folder / group).is_dir() for group in GROUPS):
            raise UsageError(
                f"--config-dir {config_dir}: holds neither setup/ nor method/ (put my_setup.yaml in "
                f"{folder}/setup/, my_method.yaml in {folder}/method/)"
            )
        if "'" in str(folder):
            raise UsageError(f"--config-dir {config_dir}: Hydra cannot take a path with a quote (') in it")
        folders.append(folder)
    return folders


def user_names(group: str, folders: Sequence[Path]) -> list[str]:
    return sorted(
        {path.stem for folder in folders for path in (folder / group).glob("*.yaml") if not path.stem.startswith("_")}
    )


def searchpath_override(recipes_dir: Path, folders: Sequence[Path]) -> list[str]:
    """`hydra.searchpath=[...]`: dppo.yaml's own entries (verl's config package), then the user's folders."""
    if not folders:
        return []
    from omegaconf import OmegaConf

    shipped = list(OmegaConf.load(recipes_dir / "dppo.yaml").hydra.searchpath)
    entries = [*shipped, *(f"file://{folder}" for folder in folders)]
    return ["hydra.searchpath=[" + ",".join(f"'{entry}'" for entry in entries) + "]"]
