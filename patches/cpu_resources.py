"""Patch of `verl.single_controller.ray.base.ResourcePoolManager._check_resource_available` on the CPU platform.

Which verl method: `_check_resource_available` compares the GPUs a run asks for (`trainer.n_gpus_per_node` x
`trainer.nnodes`, and the rollout pool of standalone replicas) with the `GPU` (or `NPU`) resources of the Ray nodes,
and raises "Total available GPUs 0 is less than total desired GPUs N" on a machine without them, although every
placement-group bundle asks for the platform's own Ray resource (`get_platform().ray_resource_name()`, `CPU` here).
What the wrapper does: on the CPU platform only, the same check counted in that resource; elsewhere verl's
check unchanged. No logical GPUs (`ray_init.num_gpus`) need to be invented for a CPU run.
Why no extension point: the resource names are hard-coded in the check.
What would retire it: verl counting `get_platform().ray_resource_name()`, as its placement groups already do.
"""

from __future__ import annotations

from typing import Any

from verl_dppo.patches._import_hook import patch_once

__all__ = ["patch_resource_check"]


def patch_resource_check(module: Any) -> None:
    def make(original):
        def _check_resource_available(self):
            from verl_dppo.plugin.cpu_platform import is_selected

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
