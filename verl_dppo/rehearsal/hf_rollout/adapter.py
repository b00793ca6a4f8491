"""`HFServerAdapter`: verl's `BaseRollout` for the `hf` backend (the worker side; registered as ("hf", "async")).

`ActorRolloutRefWorker` (hybrid: sync and colocate_async) builds it beside the FSDP engine, and verl's
`CheckpointEngineWorker` (standalone replicas: separate_async) builds it beside the checkpoint engine. Either one
calls `update_weights(weights, global_steps=...)` with a generator of (name, tensor): every rank iterates it (the
FSDP export gathers each tensor with a collective), and the replica's first rank sends the tensors to its server in
buckets of `checkpoint_engine.update_weights_bucket_megabytes`, through Ray, in host memory.
"""

from __future__ import annotations

import os
import time
from typing import Any, Generator, Optional

import ray
import torch

from verl.workers.rollout.base import BaseRollout

from verl_dppo.rehearsal.hf_rollout.server import server_name

__all__ = ["HFServerAdapter"]


class HFServerAdapter(BaseRollout):
    def __init__(self, config: Any, model_config: Any, device_mesh: Any = None, replica_rank: int = -1, **kwargs):
        super().__init__(config, model_config, device_mesh)
        rank = int(os.environ.get("RANK", 0))
        world = (
            self.config.tensor_model_parallel_size
            * self.config.data_parallel_size
            * self.config.pipeline_model_parallel_size
        )
        self.replica_rank = rank // world if replica_rank == -1 else replica_rank
        self.rollout_rank = rank % world
        self._has_server = self.rollout_rank == 0
        self._server: Optional[ray.actor.ActorHandle] = None

    @property
    def is_leader_rank(self) -> bool:
        return self._has_server

    def _server_handle(self) -> Optional[ray.actor.ActorHandle]:
        if self._has_server and self._server is None:
            self._server = ray.get_actor(server_name(self.replica_rank, 0))
        return self._server

    async def resume(self, tags: list[str]):
        if self.config.free_cache_engine and self._server_handle() is not None:
            await self._server.wake_up.remote(tags=tags)

    async def release(self):
        if self.config.free_cache_engine and self._server_handle() is not None:
            await self._server.sleep.remote()

    @torch.no_grad()
    async def update_weights(
        self,
        weights: Generator[tuple[str, torch.Tensor], None, None],
        global_steps: int = None,
        wire_format: str = "named_tensors",
        peft_config: Any = None,
        base_sync_done: bool = True,
        **kwargs,
    ):
        """One weight push, as verl makes it to vLLM: full weights, or with LoRA (model.lora_rank > 0) the frozen
        base once (`base_sync_done=False`, LoRA-targeted weights named `...base_layer.weight`) and then the
        adapter's tensors at every push (`peft_config` given), which the server merges (hf_rollout/weights.py)."""
        from verl.workers.rollout.utils import ensure_async_iterator

        from verl_dppo.rehearsal.hf_rollout.weights import lora_settings

        lora = lora_settings(peft_config) if base_sync_done else None

        if wire_format != "named_tensors":
            raise ValueError(
                f"the hf rollout takes full tensors (wire_format='named_tensors'), got {wire_format!r}: "
                "set actor_rollout_ref.rollout.checkpoint_engine.backend=ray_store (or naive)"
            )
        start = time.time()
        server = self._server_handle()
        limit = max(1, int(self.config.checkpoint_engine.update_weights_bucket_megabytes)) << 20
        bucket, size, loaded = [], 0, 0
        async for name, tensor in ensure_async_iterator(weights):  # every rank: the export is collective
            tensor = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor  # collective
            if server is None:
                continue
            bucket.append((name, tensor.detach().to("cpu", copy=True)))
            size += tensor.numel() * tensor.element_size()
            if size >= limit:
                loaded += await server.load_weights.remote(bucket, lora=lora)
                bucket, size = [], 0
        if server is None:
            return
        if bucket:
            loaded += await server.load_weights.remote(bucket, lora=lora)
        if loaded == 0:
            raise RuntimeError("the weight push to the hf rollout carried no tensors")
        await server.finish_weight_update.remote(global_steps=global_steps, loaded=loaded, lora=lora)
        self.last_update = {"tensors": loaded, "seconds": time.time() - start, "global_steps": global_steps}
