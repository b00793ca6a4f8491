"""First on PYTHONPATH in a process forced onto a lesser CPU's branches (`verl_dppo.rehearsal.isa.forced_env`): torch's
CPU probes answer as that CPU would from torch's import on, in this process and in every Python process it starts
(PYTHONPATH is inherited: Ray's workers, vLLM's spawned engine). Any other `sitecustomize` on the path runs after."""

import importlib.util
import os
import sys


def _force() -> None:
    if os.environ.get("VERL_DPPO_CPU_ISA"):
        from verl_dppo.rehearsal.isa import answer_as_forced

        answer_as_forced()


def _chain() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    for entry in sys.path:
        folder = os.path.abspath(entry or os.getcwd())
        candidate = os.path.join(folder, "sitecustomize.py")
        if folder != here and os.path.isfile(candidate):
            spec = importlib.util.spec_from_file_location("_next_sitecustomize", candidate)
            spec.loader.exec_module(importlib.util.module_from_spec(spec))
            return


_force()
_chain()
