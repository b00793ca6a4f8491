"""The `verl-dppo` command line.

Each command lives in its own module, which exposes `add_command(subparsers)`; heavy imports stay inside the
command's handler so that `verl-dppo --help` is instant.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from typing import Optional, Sequence

from verl_dppo.cli.errors import EXIT_USAGE, UsageError

COMMAND_MODULES = (
    "verl_dppo.cli.doctor",  # doctor
    "verl_dppo.cli.demo",  # demo
    "verl_dppo.cli.demo.staleness",  # staleness
    "verl_dppo.cli.plot",  # plot
    "verl_dppo.cli.launch",  # recipes, run, data
    "verl_dppo.cli.check",  # check
    "verl_dppo.cli.real_model",  # real-model
    "verl_dppo.cli.mismatch",  # mismatch
    "verl_dppo.cli.study",  # study
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="verl-dppo", description="DPPO for verl: tools around the plugin.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as error:
            if error.name == name:  # a command not shipped in this build
                continue
            raise
        module.add_command(commands)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run one command. A user's mistake (UsageError, a file that cannot be read or written, a Ray cluster that
    does not answer) is one line on stderr and exit 2; only a bug in verl-dppo itself shows a traceback."""
    try:
        args = build_parser().parse_args(argv)
    except UsageError as error:  # an option's own check (argparse's errors print the usage and exit 2 themselves)
        return _error(str(error))
    try:
        return int(args.handler(args) or 0)
    except UsageError as error:
        return _error(str(error))
    except BrokenPipeError:
        # `verl-dppo recipes -v | head`: the reader left; stop quietly. Point stdout at devnull so that the
        # interpreter's final flush does not raise the same error again.
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except (OSError, ValueError):
            pass
        return 0
    except KeyboardInterrupt:
        print("verl-dppo: interrupted", file=sys.stderr)
        return 130
    except ConnectionError as error:  # Ray's "could not connect" among them
        return _error(f"cannot connect: {_first_line(error)} (check RAY_ADDRESS / --ray-address, or start the "
                      "cluster with `ray start --head`)")
    except OSError as error:
        where = f"{error.filename}: " if error.filename else ""
        return _error(f"{where}{error.strerror or _first_line(error)}")


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def _error(message: str) -> int:
    lines = message.strip().splitlines() or [""]
    print(f"verl-dppo: error: {lines[0]}", file=sys.stderr)
    for line in lines[1:]:  # a list of problems (run) keeps its items, indented under the one error line
        print(line, file=sys.stderr)
    return EXIT_USAGE
