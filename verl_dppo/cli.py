"""The `verl-dppo` command line."""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence


def _doctor(args: argparse.Namespace) -> int:
    from verl_dppo import doctor

    return doctor.run(with_ray=not args.no_ray, ray_address=args.ray_address)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="verl-dppo", description="DPPO for verl: tools around the plugin.")
    commands = parser.add_subparsers(dest="command", required=True)

    doctor = commands.add_parser("doctor", help="check the install: versions, registered modes, anchoring hook")
    doctor.add_argument("--no-ray", action="store_true", help="skip the check inside a Ray worker process")
    doctor.add_argument("--ray-address", default=None, help="check on this Ray cluster instead of a local instance")
    doctor.set_defaults(handler=_doctor)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
