"""What the interpreter a venv is made with costs every process of a run: `import verl` (the plugin loading through
verl's entry point) under each Python 3.11 on PATH, all on this checkout's .venv site-packages.

Most of a CPU launch's time is its processes starting and importing verl (docs/development.md), and `make` builds
.venv with the fastest Python 3.11 on PATH (tools/fastest-python). Each side is a fresh child process per import,
the sides taking turns (this machine is noisy); its CPU time (user + system, from wait4) and wall time. The
baseline is the first interpreter given, or the one .venv was made with.

    .venv/bin/python bench/interpreter_import.py [--python P ...] [--repeats 9]
"""

from __future__ import annotations

import argparse
import importlib.machinery
import importlib.util
import os
import statistics
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
IMPORT = "import site, sys; site.addsitedir(sys.argv[1]); import verl"


def venv_interpreter() -> str:
    return os.path.realpath(getattr(sys, "_base_executable", sys.executable))


def candidates() -> list[str]:
    """The Python 3.11 interpreters tools/fastest-python would time, .venv's own first."""
    # the tool's own list, without its timed loops (the file has no .py suffix: load it by path)
    loader = importlib.machinery.SourceFileLoader("fastest_python", str(REPO / "tools" / "fastest-python"))
    spec = importlib.util.spec_from_loader(loader.name, loader)
    tool = importlib.util.module_from_spec(spec)
    loader.exec_module(tool)
    found = tool.candidates()
    own = venv_interpreter()
    return [own] + [python for python in found if python != own]


def one_import(python: str, site_packages: str) -> tuple[float, float]:
    start = time.perf_counter()
    # -S: none of the interpreter's own site-packages (pyenv's and Debian's hold other versions of some packages)
    child = subprocess.Popen([python, "-S", "-c", IMPORT, site_packages], stdout=subprocess.DEVNULL)
    _, status, usage = os.wait4(child.pid, 0)
    wall = time.perf_counter() - start
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{python} failed to import verl on {site_packages}")
    return usage.ru_utime + usage.ru_stime, wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--python",
        action="append",
        help="an interpreter to time (repeatable); default: each "
        "Python 3.11 on PATH, the one .venv was made with first",
    )
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args()
    pythons = args.python or candidates()
    site_packages = sysconfig.get_paths()["purelib"]
    cpu = {python: [] for python in pythons}
    wall = {python: [] for python in pythons}
    for python in pythons:  # a first import each, not timed: the page cache warm for every side alike
        one_import(python, site_packages)
    for _ in range(args.repeats):
        for python in pythons:
            seconds_cpu, seconds_wall = one_import(python, site_packages)
            cpu[python].append(seconds_cpu)
            wall[python].append(seconds_wall)
    base_cpu, base_wall = statistics.median(cpu[pythons[0]]), statistics.median(wall[pythons[0]])
    print(f"import verl on {site_packages}, median of {args.repeats}, sides interleaved:")
    for python in pythons:
        median_cpu, median_wall = statistics.median(cpu[python]), statistics.median(wall[python])
        print(
            f"  {python}: CPU {median_cpu:.2f} s ({median_cpu / base_cpu:.2f}x), "
            f"wall {median_wall:.2f} s ({median_wall / base_wall:.2f}x)"
        )


if __name__ == "__main__":
    main()
