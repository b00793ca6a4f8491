"""The `verl-dppo` command line.

Each command lives in its own module, which exposes `add_command(subparsers)`; heavy imports stay inside the
command's handler so that `verl-dppo --help` is instant.
"""

from __future__ import annotations

import argparse
import importlib
from typing import Optional, Sequence

COMMAND_MODULES = (
    "verl_dppo.cli.doctor",  # doctor
    "verl_dppo.cli.demo",  # demo
    "verl_dppo.cli.plot",  # plot
    "verl_dppo.cli.launch",  # recipes, run, data
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
    args = build_parser().parse_args(argv)
    return int(args.handler(args) or 0)
