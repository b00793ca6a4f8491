"""vLLM's shared-memory queues with a short busy wait, on the CPU platform: a vLLM plugin (`vllm.general_plugins`).

| patch                     | upstream                                                  | what it does on CPU                  |
|---------------------------|-----------------------------------------------------------|--------------------------------------|
| `patch_spin_condition`    | vllm distributed/device_communicators/shm_broadcast.py:130-144 (`SpinCondition.__init__`: `busy_loop_s: float = 1`, passed by no caller) and :203-205 (`wait`: `sched_yield()` for `busy_loop_s` after each read before it polls the zmq socket) | a reader's `busy_loop_s` is `BUSY_LOOP_S` (50 ms): after that it waits on the writer's zmq notification |

verl's vLLM server runs vLLM with `distributed_executor_backend="mp"`: the engine core process sends each step to
its worker process, and waits for the reply, through these queues. A reader spins for a second after each read, and
a decode step on a CPU takes about that long, so the engine core never goes idle while its worker computes: it
burns most of a core beside the worker, taken from the trainer or another run on a machine with few cores
(`python bench/vllm_spin.py` measures it; its figures, and the weight pushes below, in docs/benchmarks.md). Not 0:
vLLM's notifications can be lost (shm_broadcast.py:64-67, "lost-notify recovery latency to ~5s"), and without any
busy loop they were, in bursts of messages (the separate_async vLLM launch's weight pushes then waited out vLLM's
recovery at some steps); with BUSY_LOOP_S none did, and a step a worker computes for longer (a CPU decode step) is
waited for asleep. On a GPU the spin saves
microseconds a step and the CPU it burns is not the accelerator's: off the CPU platform nothing is patched.

vLLM spawns its engine core and workers from a Ray actor (`_maybe_force_spawn`), so a patch made in the server's
process does not reach them; vLLM loads every `vllm.general_plugins` entry point in each of its processes (the
engine core before its executor builds the queues, each worker before its model), which is where `register` runs.
It imports neither verl nor vLLM: the patch is applied when vLLM imports `shm_broadcast`. `VLLM_PLUGINS` (vLLM's
allowlist of plugins, e.g. `VLLM_PLUGINS=`) turns it off.
"""

from __future__ import annotations

from typing import Any

from verl_dppo.patches._import_hook import patch_once, when_imported
from verl_dppo.rehearsal.selection import is_selected

__all__ = ["patch_spin_condition", "register"]

MODULE = "vllm.distributed.device_communicators.shm_broadcast"
BUSY_LOOP_S = 0.05
"""How long a queue reader spins after a read before it waits on the writer's notification (vLLM's: 1 s)."""


def register() -> None:
    """The `dppo_cpu` entry point in vLLM's `vllm.general_plugins` group: on the CPU platform, patch the queues'
    `SpinCondition` when vLLM imports it (now if it already has)."""
    if is_selected():
        when_imported(MODULE, patch_spin_condition)


def patch_spin_condition(shm_broadcast: Any) -> None:
    """`SpinCondition.__init__`: a reader's `busy_loop_s` set to BUSY_LOOP_S after vLLM's own initialisation (a
    writer's is 0 already). A vLLM without the class (its queues wait another way) is left alone."""
    spin_condition = getattr(shm_broadcast, "SpinCondition", None)
    if spin_condition is None:
        return

    def make(original):
        def __init__(self, *args, **kwargs):
            original(self, *args, **kwargs)
            if getattr(self, "is_reader", False):
                self.busy_loop_s = BUSY_LOOP_S

        return __init__

    patch_once(spin_condition, "__init__", make)
