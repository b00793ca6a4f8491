"""Patch of `verl.single_controller.ray.base.ResourcePoolManager._check_resource_available` on the CPU platform.

Which verl method: `_check_resource_available` compares the GPUs a run asks for (`trainer.n_gpus_per_node` x
`trainer.nnodes`, and the rollout pool of standalone replicas) with the `GPU` (or `NPU`) resources of the Ray nodes,
and raises "Total available GPUs 0 is less than total desired GPUs N" on a machine without them, although every
placement-group bundle asks for the platform's own Ray resource (`get_platform().ray_resource_name()`, `CPU` here).
What the wrapper does: on the CPU platform only, the same check counted in that resource; elsewhere verl's
check unchanged. No logical GPUs (`ray_init.num_gpus`) need to be invented for a CPU run.
Why no extension point: the resource names are hard-coded in the check.
What would retire it: verl counting `get_platform().ray_resource_name()`, as its placement groups already do.

Also `RayWorkerGroup._get_master_addr_port` on the CPU platform: verl 0.9.1 picks a worker group's `MASTER_PORT` by
binding port 0 and closing it (`get_master_addr_port`, single_controller/ray/base.py:95), and the group's rank 0
binds it again seconds later (torch's TCPStore): a port of the kernel's ephemeral range, which every outgoing
connection and every other `bind(0)` on the machine draws from meanwhile. Two jobs on one machine (the suite's vLLM
lanes) lost that race once ("EADDRINUSE" in the standalone rollout's `CheckpointEngineWorker`). On the CPU platform
the wrapper hands verl's own `master_port_range` scan a range below the ephemeral range and above Ray's worker ports
(`MASTER_PORTS`), from a random start: a port the kernel hands no other socket, so only another job's explicit bind in
that range could take it. A range or port the caller set is kept; elsewhere verl's pick is unchanged.
What would retire it: verl keeping the reserving socket open until rank 0 binds (its `get_free_port(...,
with_alive_sock=True)` in utils/net_utils.py does that for other ports), or a `master_port_range` in the trainer config.
"""

from __future__ import annotations

import random
from typing import Any

from verl_dppo.patches._import_hook import patch_once

__all__ = ["MASTER_PORTS", "patch_resource_check", "port_scan_range"]

MASTER_PORTS = (20000, 32768)
"""Where a CPU run's worker groups take their MASTER_PORT: above Ray's worker ports (10002-19999 by default), below
Linux's ephemeral ports (32768-60999 by default, /proc/sys/net/ipv4/ip_local_port_range)."""
_START_SPREAD = 8192
"""Starts are drawn from the first 8,192 ports of MASTER_PORTS, so a scan always has 4,575 ports or more to go."""


def patch_resource_check(module: Any) -> None:
    """Both CPU-platform patches of `verl.single_controller.ray.base` (the module docstring)."""

    def make(original):
        def _check_resource_available(self):
            from verl_dppo.rehearsal.platform import is_selected

            if not is_selected():
                return original(self)
            import ray

            available = sum(node.get("CPU", 0) for node in ray._private.state.available_resources_per_node().values())
            required = sum(n for process_on_nodes in self.resource_pool_spec.values() for n in process_on_nodes)
            if available < required:
                raise ValueError(
                    f"Total available CPUs {available} in the Ray cluster is less than the {required} worker processes "
                    "the run asks for on the CPU platform: lower trainer.n_gpus_per_node (and the rollout pool's "
                    "rollout.n_gpus_per_node), or give Ray more CPUs (ray_kwargs.ray_init.num_cpus)"
                )

        return _check_resource_available

    patch_once(module.ResourcePoolManager, "_check_resource_available", make)
    patch_once(module.RayWorkerGroup, "_get_master_addr_port", _make_master_addr_port)


def port_scan_range() -> list[int]:
    """A [start, end) range for verl's port scan: a random start (the OS's entropy, not `random`'s seeded state, so two
    jobs seeded alike do not start alike), the end of MASTER_PORTS."""
    low, high = MASTER_PORTS
    return [random.SystemRandom().randrange(low, low + _START_SPREAD), high]


def _make_master_addr_port(original):
    def _get_master_addr_port(self, pg, bundle_index=0, master_port_range=None):
        from verl_dppo.rehearsal.platform import is_selected

        if master_port_range is None and getattr(self, "_master_port", None) is None and is_selected():
            master_port_range = port_scan_range()
        return original(self, pg, bundle_index=bundle_index, master_port_range=master_port_range)

    return _get_master_addr_port
