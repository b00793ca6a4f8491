"""`ray_store`: a checkpoint engine for `separate_async` that needs no NCCL, so it runs on the CPU platform.

verl's `separate_async` trainer refuses the `naive` engine (it only works inside one process) and the recipes'
`nccl` needs GPUs. This engine, registered in verl's `CheckpointEngineRegistry` at plugin load, passes each weight
version through a named Ray actor of the run: the actor's rank 0 gathers the exported tensors (every rank iterates
the export: it is collective) and puts them in the store under their version in buckets; each rollout worker's
`receive_weights(global_steps=v)` waits for version v and yields its tensors. Host memory and Ray's object store
carry the weights, so it also works between GPU nodes, slower than NCCL (`checkpoint_engine.backend=nccl` there).

The store holds one version at a time (a new version replaces the old). It is a plain (non-detached) named actor
owned by the process that created it; every process that uses it keeps its handle in `_STORE`.
"""

from __future__ import annotations

import asyncio
from typing import Any, AsyncGenerator, Optional

import ray

__all__ = ["BACKEND", "register"]

BACKEND = "ray_store"
STORE_NAME = "verl_dppo_ray_store"


class _Store:
    """version -> list of buckets of (name, tensor), complete when `commit` was called."""

    def __init__(self):
        self._version: Optional[int] = None
        self._buckets: list = []
        self._complete = asyncio.Event()

    def begin(self, version: int) -> None:
        self._version, self._buckets = version, []
        self._complete = asyncio.Event()

    def put(self, version: int, bucket: list) -> None:
        if version != self._version:
            raise RuntimeError(f"bucket of version {version} while version {self._version} is being written")
        self._buckets.append(bucket)

    def commit(self, version: int) -> int:
        if version != self._version:
            raise RuntimeError(f"commit of version {version} while version {self._version} is being written")
        self._complete.set()
        return len(self._buckets)

    async def count(self, version: int, timeout: float = 600.0) -> int:
        """Number of buckets of `version`, once it is complete."""
        deadline = asyncio.get_running_loop().time() + timeout
        while not (self._version == version and self._complete.is_set()):
            if asyncio.get_running_loop().time() > deadline:
                raise TimeoutError(f"weight version {version} never reached the ray_store checkpoint engine")
            await asyncio.sleep(0.01)
        return len(self._buckets)

    def bucket(self, version: int, index: int) -> list:
        if version != self._version:
            raise RuntimeError(f"version {version} was replaced by {self._version} while being read")
        return self._buckets[index]


_STORE: dict[str, Any] = {}


def _store():
    if "handle" not in _STORE:
        _STORE["handle"] = ray.remote(_Store).options(name=STORE_NAME, get_if_exists=True, max_concurrency=64).remote()
    return _STORE["handle"]


def register(module: Any) -> None:
    """Patch-hook for verl.checkpoint_engine.base: register the engine under BACKEND."""
    if BACKEND in module.CheckpointEngineRegistry._registry:
        return

    @module.CheckpointEngineRegistry.register(BACKEND)
    class RayStoreCheckpointEngine(module.CheckpointEngine):
        def __init__(self, bucket_size: int = 256 << 20, is_master: bool = False, **kwargs: Any) -> None:
            self.bucket_size = max(1, int(bucket_size))
            self.is_master = is_master

        def prepare(self) -> dict:
            _store()  # created (or found) in every participating process, which keeps its handle
            return {}

        @classmethod
        def build_topology(cls, trainer_world_size: int, rollout_world_size: int, metadata: list):
            return {}, {}

        def init_process_group(self, **kwargs) -> None:
            return None

        def finalize(self) -> None:
            return None

        async def send_weights(self, weights, global_steps: Optional[int] = None):
            from verl.workers.rollout.utils import ensure_async_iterator

            if global_steps is None:
                raise ValueError("the ray_store checkpoint engine needs the weight version (global_steps)")
            store = _store() if self.is_master else None
            if store is not None:
                await store.begin.remote(int(global_steps))
            bucket, size = [], 0
            async for name, tensor in ensure_async_iterator(weights):
                tensor = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor  # collective
                if store is None:
                    continue
                bucket.append((name, tensor.detach().to("cpu", copy=True)))
                size += tensor.numel() * tensor.element_size()
                if size >= self.bucket_size:
                    await store.put.remote(int(global_steps), bucket)
                    bucket, size = [], 0
            if store is not None:
                if bucket:
                    await store.put.remote(int(global_steps), bucket)
                await store.commit.remote(int(global_steps))
            return {}

        async def receive_weights(self, global_steps: Optional[int] = None) -> AsyncGenerator:
            if global_steps is None:
                raise ValueError("the ray_store checkpoint engine needs the weight version (global_steps)")
            store = _store()
            for index in range(await store.count.remote(int(global_steps))):
                for name, tensor in await store.bucket.remote(int(global_steps), index):
                    yield name, tensor

    return None
