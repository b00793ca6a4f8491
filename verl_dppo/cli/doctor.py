"""`verl-dppo doctor`: is the plugin installed and loaded, here and inside a Ray worker?"""

from __future__ import annotations

import sys
from importlib.metadata import PackageNotFoundError, version
from typing import Optional

EXPECTED_MODES = ("dppo_binary_tv", "dppo_binary_kl", "grpo_clip", "pg_is", "dppo_topk_tv", "dppo_topk_kl")
_PACKAGES = ("verl", "torch", "ray", "transformers", "vllm", "sglang", "verl-dppo")


def _version_of(package: str) -> Optional[str]:
    try:
        return version(package)
    except PackageNotFoundError:
        return None


def probe_process() -> dict:
    """What `import verl` alone gives this process: our modes in the registry and the anchoring hook."""
    import verl  # noqa: F401  (loads the verl.plugins entry points)
    from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY

    from verl_dppo.patches.workers_utils_losses import is_installed

    return {
        "registered": sorted(mode for mode in EXPECTED_MODES if mode in POLICY_LOSS_REGISTRY),
        "hook_installed": is_installed(),
    }


def _probe_in_worker() -> dict:
    # Runs in a Ray worker: import verl only, exactly as verl's own workers do.
    import os

    import verl  # noqa: F401
    from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY

    import verl.workers.utils.losses as losses

    return {
        "registered": sorted(mode for mode in EXPECTED_MODES if mode in POLICY_LOSS_REGISTRY),
        "hook_installed": bool(getattr(losses.ppo_loss, "__verl_dppo_wrapped__", False)),
        "pid": os.getpid(),
    }


def probe_ray_worker(address: Optional[str] = None, timeout_s: float = 120.0) -> dict:
    """Run the probe in a Ray worker process (a fresh local Ray instance unless `address` names a cluster), in a
    child process killed after `timeout_s`: `ray.init` on a silent address would otherwise wait for minutes."""
    from verl_dppo.cli.ray_probe import run_probe

    return run_probe("worker", address, timeout_s)


from verl_dppo.cli.ray_probe import RayUnreachable, check_address  # noqa: E402  (stdlib only)


def run(with_ray: bool = True, ray_address: Optional[str] = None, out=None, timeout_s: float = 120.0) -> int:
    out = out or sys.stdout
    if with_ray and ray_address:  # before anything slow: a wrong address is one line, at once
        check_address(ray_address, "--ray-address")
    problems, warnings = [], []
    print("verl-dppo doctor", file=out)
    for package in _PACKAGES:
        print(f"  {package:<13} {_version_of(package) or 'not installed'}", file=out)

    from verl_dppo.plugin.compat import SUPPORTED_VERL_RANGE, SUPPORTED_VERL_VERSIONS

    verl_version = _version_of("verl")
    if verl_version not in SUPPORTED_VERL_VERSIONS:
        problems.append(f"verl {verl_version} is outside the supported range {SUPPORTED_VERL_RANGE}")
    if not (_version_of("vllm") or _version_of("sglang")):
        warnings.append("neither vLLM nor SGLang is installed here: every recipe, and any verl RL run, needs one of "
                        "them as the rollout engine on the GPU nodes (pip install verl[vllm] or verl[sglang])")

    def report(where: str, probe: dict) -> None:
        missing = [mode for mode in EXPECTED_MODES if mode not in probe["registered"]]
        print(f"  {where}: modes {', '.join(probe['registered']) or 'none'}; "
              f"anchoring hook {'installed' if probe['hook_installed'] else 'MISSING'}", file=out)
        if missing:
            problems.append(f"{where}: loss modes not registered: {', '.join(missing)}")
        if not probe["hook_installed"]:
            problems.append(f"{where}: the rollout-anchoring hook around verl's ppo_loss is not installed")

    try:
        report("this process", probe_process())
    except Exception as error:  # a broken install must be reported, not crash the doctor
        problems.append(f"this process: importing verl / the plugin failed: {error!r}")
    if with_ray:
        try:
            report("ray worker", probe_ray_worker(ray_address, timeout_s))
        except RayUnreachable:
            if ray_address:  # the user's address is wrong, not the install: one line, exit 2
                raise
            problems.append("ray worker: a local Ray instance did not start; check `ray start --head` by hand")
        except Exception as error:
            problems.append(f"ray worker: the probe failed: {error}")
    else:
        print("  ray worker: skipped (--no-ray)", file=out)

    for warning in warnings:
        print(f"WARNING: {warning}", file=out)
    if problems:
        print("PROBLEMS:", file=out)
        for problem in problems:
            print(f"  - {problem}", file=out)
        print("Fix: install verl-dppo (pip install . from a checkout, or its wheel) beside verl==0.9.1 in every node's environment; "
              "VERL_USE_EXTERNAL_PLUGINS must be 'auto' or name 'dppo'.", file=out)
        return 1
    print("OK: verl-dppo is installed and loads with `import verl`.", file=out)
    return 0


def add_command(commands) -> None:
    parser = commands.add_parser("doctor", help="check the install: versions, registered modes, anchoring hook")
    parser.add_argument("--no-ray", action="store_true", help="skip the check inside a Ray worker process")
    parser.add_argument("--ray-address", default=None, help="check on this Ray cluster instead of a local instance")
    parser.add_argument("--timeout", type=float, default=120.0, metavar="S",
                        help="give up on the Ray worker check after S seconds (default 120)")
    parser.set_defaults(handler=lambda args: run(with_ray=not args.no_ray, ray_address=args.ray_address,
                                                 timeout_s=args.timeout))
