"""A `main_ppo` launch line as a user pastes it into `verl-dppo check`: which words launch, which are Hydra's.

verl's example scripts launch `main_ppo` in many ways: `python3 -m verl.trainer.main_ppo`, `uv run --frozen
--extra vllm python3 -m ...` (most of the 0.9-era scripts), `torchrun ... -m ...`, `ray job submit ... -- python3 -m
...`, `VAR=value python3 ...`, or `python3 path/to/main_ppo.py`. Everything up to the entry point (the module after
`-m`, or the `.py` file) is the launcher's; after it come Hydra's flags and overrides. Only `main_ppo` is understood:
another entry point is named in one line (a module verl does not have, too).

Hydra resolves a relative `--config-path` against the folder of the file that declares `@hydra.main` (for
`python -m`, the module's package), not the working folder: `--config-path=config` means `verl/trainer/config`.
`config_folder` does what Hydra does (its own `compute_search_path_dir`). The folders a command adds to Hydra's
search path (`hydra.searchpath=[pkg://...]`, or the primary config's own) are looked up here: one that is not on this
machine (a config package that is not installed) is "not here", named once (`missing_search_paths`).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

from verl_dppo.errors import UsageError

__all__ = ["Launch", "parse_launch", "config_folder", "missing_search_paths", "MAIN_PPO"]

MAIN_PPO = "verl.trainer.main_ppo"
_HYDRA_VALUE_FLAGS = {
    "--config-path": "path",
    "-cp": "path",
    "--config-name": "name",
    "-cn": "name",
    "--config-dir": "dir",
    "-cd": "dir",
}
_ENV_WORD = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
_SHELL_WORDS = ("\\", "$@", '"$@"', "${@}", '"${@}"', "--")


@dataclass
class Launch:
    """What a launch line asks of `main_ppo`: its overrides and its primary config."""

    overrides: list[str] = field(default_factory=list)
    config_path: Optional[str] = None
    """`--config-path` as given (None: main_ppo's own `config` folder)."""
    config_name: str = "ppo_trainer"
    config_dirs: list[str] = field(default_factory=list)
    """`--config-dir` folders: added to the search path."""
    entry_file: Optional[str] = None
    """The `.py` file launched (None: the module `verl.trainer.main_ppo`, or the overrides alone)."""
    launcher: list[str] = field(default_factory=list)
    """The words before the entry point (`uv run --extra vllm python3`, `torchrun --nproc_per_node=8`, `VAR=1`)."""


def _module_exists(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # a parent package that is not there
        return False


def _other_entry(entry: str) -> UsageError:
    """One line for an entry point that is not main_ppo."""
    import verl

    module = entry.removesuffix(".py").replace("/", ".").lstrip(".") if entry.endswith(".py") else entry
    if not entry.endswith(".py") and not _module_exists(entry):
        return UsageError(
            f"{entry}: verl {verl.__version__} (installed here) has no such module; `check` reads "
            f"{MAIN_PPO}'s command line (`python3 -m {MAIN_PPO} ...`)"
        )
    hint = ""
    if "fully_async" in module or "one_step_off" in module:
        hint = (
            "; the plugin runs verl's asynchronous trainers through main_ppo's v1 trainer "
            "(trainer.v1.trainer_mode, `verl-dppo run SETUP --trainer-mode MODE`)"
        )
    return UsageError(
        f"{entry}: another entry point than {MAIN_PPO}, with its own config: `check` reads only "
        f"{MAIN_PPO}'s command line, so this one is not checked{hint}"
    )


def _entry_index(words: Sequence[str]) -> tuple[int, int, Optional[str]]:
    """(where the entry point's words start, the first word after them, the entry: a module or a .py file), or
    (0, 0, None) for the overrides alone."""
    for index, word in enumerate(words):
        if word in ("-m", "--module") and index + 1 < len(words):
            return index, index + 2, words[index + 1]
        if word.startswith("--module="):
            return index, index + 1, word.split("=", 1)[1]
        if word.endswith(".py") and "=" not in word:
            return index, index + 1, word
    return 0, 0, None


def _unquoted(argv: Sequence[str]) -> list[str]:
    """The words, with a whole command passed as one quoted word (`check "python3 -m verl.trainer.main_ppo a=b"`)
    split as the shell would have: a word with white space whose first part is not an override (an override's value
    may hold spaces: `key='a b'` stays one word)."""
    import shlex

    words = []
    for word in argv:
        parts = shlex.split(word) if any(c.isspace() for c in word.strip()) else [word]
        first = parts[0]
        command = "=" not in first or (_ENV_WORD.match(first) and first.split("=", 1)[0].isupper())
        words += parts if len(parts) > 1 and command else [word]
    return words


def parse_launch(argv: Sequence[str]) -> Launch:
    """The launch line's parts (see the module's docstring); UsageError for a word that is no Hydra override, or an
    entry point other than main_ppo."""
    words = [word for word in _unquoted(argv) if word not in _SHELL_WORDS]
    script = next((word for word in words if word.endswith((".sh", ".bash")) and "=" not in word), None)
    if script is not None:
        raise UsageError(
            f"{script}: a shell script; `check` reads the main_ppo command line a script runs, not the "
            "script: pass that line's words (python3 -m verl.trainer.main_ppo and its overrides, the "
            "script's variables filled in) after `verl-dppo check`, or its overrides alone"
        )
    begin, start, entry = _entry_index(words)
    launch = Launch()
    if entry is not None:
        launch.launcher = list(words[:begin])
        if entry.endswith(".py"):
            if Path(entry).name != "main_ppo.py":
                raise _other_entry(entry)
            launch.entry_file = entry
        elif entry != MAIN_PPO:
            raise _other_entry(entry)
        words = words[start:]
    else:  # the overrides alone, maybe behind `VAR=value` words of the shell (upper case, no dot: not Hydra's)
        while words and _ENV_WORD.match(words[0]) and words[0].split("=", 1)[0].isupper():
            launch.launcher.append(words.pop(0))
    index = 0
    while index < len(words):
        word = words[index]
        index += 1
        flag, _, value = word.partition("=") if word.startswith("--config-") else (word, "", "")
        if flag in _HYDRA_VALUE_FLAGS:
            if not value:
                if index >= len(words):
                    raise UsageError(f"{word} needs a value")
                value, index = words[index], index + 1
            kind = _HYDRA_VALUE_FLAGS[flag]
            if kind == "path":
                launch.config_path = value
            elif kind == "name":
                launch.config_name = value
            else:
                launch.config_dirs.append(value)
        elif "=" in word or word.startswith("~"):
            launch.overrides.append(word)
        else:
            raise UsageError(f"{word!r} is not a Hydra override (key=value) of a main_ppo command line")
    if not launch.overrides and launch.config_path is None and launch.config_name == "ppo_trainer":
        raise UsageError("give the main_ppo command line (or its overrides) to check")  # verl's example config alone
    return launch


def config_folder(launch: Launch) -> Path:
    """The primary config folder, as Hydra finds it for main_ppo: `@hydra.main(config_path="config")` or the
    command's `--config-path`, relative to the file that declares `@hydra.main` (a module's package under `-m`)."""
    from hydra._internal.utils import compute_search_path_dir

    import verl.trainer.main_ppo as main_ppo

    path = launch.config_path if launch.config_path is not None else "config"
    if launch.entry_file is not None and Path(launch.entry_file).is_file():
        where = compute_search_path_dir(launch.entry_file, None, path)
    else:
        where = compute_search_path_dir(main_ppo.__file__, None, path)
    return Path(_pkg_folder(where) if where.startswith("pkg://") else where)


def _pkg_folder(where: str) -> str:
    """`pkg://a.b/sub` as a folder on this machine ('' where the package is not installed here)."""
    package, _, sub = where[len("pkg://") :].partition("/")
    if not package or not _module_exists(package):
        return ""
    spec = importlib.util.find_spec(package)
    roots = list(spec.submodule_search_locations or []) if spec else []
    return os.path.normpath(os.path.join(roots[0], sub)) if roots else ""


def missing_search_paths(overrides: Sequence[str], primary: Optional[Path] = None) -> list[str]:
    """One "not here" line for each folder of Hydra's search path that is not on this machine: a `pkg://` config
    package that is not installed, a `file://` (or plain) folder that does not exist. The search path is the
    command's `hydra.searchpath=[...]`, else the primary config's own `hydra.searchpath` (`primary`: its YAML file;
    verl's multi-turn configs add `file://verl/trainer/config`, relative to the folder the command runs in)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException
    from omegaconf import OmegaConf

    entries = []
    for override in overrides:
        if override.lstrip("+").startswith("hydra.searchpath="):
            try:
                value = OverridesParser.create().parse_overrides([override])[0].value()
            except HydraException:
                continue  # composing names Hydra's own parse error
            entries += value if isinstance(value, list) else [value]
    if not entries and primary is not None and primary.is_file():
        with contextlib.suppress(Exception):  # a YAML that does not load: composing names Hydra's error
            entries = list(OmegaConf.select(OmegaConf.load(primary), "hydra.searchpath", default=None) or [])
    return [line for line in map(_missing_entry, map(str, entries)) if line]


def _missing_entry(entry: str) -> Optional[str]:
    if entry.startswith("pkg://"):
        package = entry[len("pkg://") :].partition("/")[0]
        if not _module_exists(package):
            names = package.split(".")
            depth = next((d for d in range(1, len(names) + 1) if not _module_exists(".".join(names[:d]))), 0)
            package = ".".join(names[:depth]) if depth else package
            return (
                f"hydra.searchpath: {entry}: the Python package {package!r} is not installed "
                "here, so the configs it adds cannot be read; install it (or check where it is)"
            )
        if not Path(_pkg_folder(entry) or "/nonexistent").is_dir():
            return f"hydra.searchpath: {entry}: the package {package!r} is installed but has no such folder"
        return None
    if (folder := Path(entry[len("file://") :] if entry.startswith("file://") else entry).expanduser()).is_dir():
        return None
    relative = "" if folder.is_absolute() else f" (from {os.getcwd()}: verl's scripts run from its checkout's root)"
    return f"hydra.searchpath: {entry}: no such folder here{relative}, so the configs it adds cannot be read"
