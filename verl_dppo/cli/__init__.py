"""The `verl-dppo` command line: argument parsing and the list of commands, nothing else.

Each command lives with what it does and exposes `add_command(subparsers)`: launching and checking a run in
`verl_dppo.launch` (recipes, run, data, check, doctor), the studies in `verl_dppo.studies` (demo, staleness, plot,
mismatch, study, moe-pair), the real LLM's build in the CPU rehearsal (`verl_dppo.rehearsal.setups.real_model`). This package
is the top of the layers: nothing imports it but the `verl-dppo` script and `python -m verl_dppo.cli`. Heavy imports
stay inside each command's handler so that `verl-dppo --help` is instant.
"""

from __future__ import annotations

import argparse
import importlib
from typing import Optional, Sequence

from verl_dppo.errors import UsageError, report, run_handler

COMMAND_MODULES = (
    "verl_dppo.launch.doctor",  # doctor
    "verl_dppo.studies.demo",  # demo
    "verl_dppo.studies.demo.staleness",  # staleness
    "verl_dppo.studies.plot",  # plot
    "verl_dppo.launch.commands",  # recipes, run, data
    "verl_dppo.launch.check",  # check
    "verl_dppo.rehearsal.setups.real_model",  # real-model
    "verl_dppo.studies.mismatch",  # mismatch
    "verl_dppo.studies.study",  # study
    "verl_dppo.studies.moe_pair",  # moe-pair
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
    does not answer) is one line on stderr and exit 2 (`verl_dppo.errors.run_handler`); only a bug in verl-dppo
    itself shows a traceback."""
    try:
        args = build_parser().parse_args(argv)
    except UsageError as error:  # an option's own check (argparse's errors print the usage and exit 2 themselves)
        return report(str(error))
    return run_handler(args)
