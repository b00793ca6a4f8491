"""The `hf` rollout backend: a transformers model behind verl's rollout interfaces, on CPU and CUDA alike.

`register()` puts it in verl's two rollout registries (the plugin calls it when verl imports them):
`RolloutReplicaRegistry["hf"]` (driver: `HFReplica` launches the server actors) and
`verl.workers.rollout.base._ROLLOUT_REGISTRY[("hf", "async")]` (workers: `HFServerAdapter` pushes the weights).
Selected with `actor_rollout_ref.rollout.name=hf`. Modules: `engine` (batched generation with a KV cache, sampling,
top-K rows), `server` (the Ray actor), `replica`, `adapter`.
"""

from __future__ import annotations

from verl_dppo.plugin.rollout_fields import HF_ROLLOUT as NAME, SAMPLE_KWARG  # the name; the patch's keyword

__all__ = ["NAME", "SAMPLE_KWARG", "register_replica", "register_adapter"]


def _load_replica():
    from verl_dppo.rehearsal.hf_rollout.replica import HFReplica

    return HFReplica


def register_replica(module) -> None:
    """Patch-hook for verl.workers.rollout.replica: the driver-side registry."""
    module.RolloutReplicaRegistry.register(NAME, _load_replica)


def register_adapter(module) -> None:
    """Patch-hook for verl.workers.rollout.base: the worker-side registry."""
    module._ROLLOUT_REGISTRY[(NAME, "async")] = "verl_dppo.rehearsal.hf_rollout.adapter.HFServerAdapter"
