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
    """Run the probe in a Ray worker process: a fresh local Ray instance unless `address` names a cluster."""
    import ray

    started_here = not ray.is_initialized()
    if started_here:
        kwargs = {"address": address} if address else {"num_cpus": 1, "include_dashboard": False}
        ray.init(log_to_driver=False, configure_logging=False, **kwargs)
    try:
        remote = ray.remote(num_cpus=0)(_probe_in_worker)
        return ray.get(remote.remote(), timeout=timeout_s)
    finally:
        if started_here:
            ray.shutdown()


def run(with_ray: bool = True, ray_address: Optional[str] = None, out=sys.stdout) -> int:
    problems = []
    print("verl-dppo doctor", file=out)
    for package in _PACKAGES:
        print(f"  {package:<13} {_version_of(package) or 'not installed'}", file=out)

    from verl_dppo.plugin.compat import SUPPORTED_VERL_RANGE, SUPPORTED_VERL_VERSIONS

    verl_version = _version_of("verl")
    if verl_version not in SUPPORTED_VERL_VERSIONS:
        problems.append(f"verl {verl_version} is outside the supported range {SUPPORTED_VERL_RANGE}")

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
            report("ray worker", probe_ray_worker(ray_address))
        except Exception as error:
            problems.append(f"ray worker: the probe failed: {error!r}")
    else:
        print("  ray worker: skipped (--no-ray)", file=out)

    if problems:
        print("PROBLEMS:", file=out)
        for problem in problems:
            print(f"  - {problem}", file=out)
        print("Fix: pip install verl-dppo beside verl==0.9.1 in every node's environment; "
              "VERL_USE_EXTERNAL_PLUGINS must be 'auto' or name 'dppo'.", file=out)
        return 1
    print("OK: verl-dppo is installed and loads with `import verl`.", file=out)
    return 0


def add_command(commands) -> None:
    parser = commands.add_parser("doctor", help="check the install: versions, registered modes, anchoring hook")
    parser.add_argument("--no-ray", action="store_true", help="skip the check inside a Ray worker process")
    parser.add_argument("--ray-address", default=None, help="check on this Ray cluster instead of a local instance")
    parser.set_defaults(handler=lambda args: run(with_ray=not args.no_ray, ray_address=args.ray_address))
