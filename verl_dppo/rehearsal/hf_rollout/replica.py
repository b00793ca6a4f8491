"""`HFReplica`: verl's `RolloutReplica` for the `hf` backend (the driver side; registered as "hf").

verl's `LLMServerManager` builds one replica per rollout replica rank and calls `init_hybrid` (sync and
colocate_async: the servers sit beside the FSDP workers and get their weights from them) or `init_standalone`
(separate_async: a pool of its own, weights through the checkpoint engine). Either way `launch_servers` starts one
`HFRolloutServer` actor per node of the replica, on the node of its workers, with their accelerator ids.
"""

from __future__ import annotations

import asyncio

import ray

from verl.workers.rollout.replica import RolloutReplica

from verl_dppo.rehearsal.hf_rollout.server import HFRolloutServer, server_name

__all__ = ["HFReplica"]


def _placement(worker_self):
    """(node id, accelerator ids) of a worker; on the CPU platform Ray reports no accelerator: none."""
    from verl.utils.device import get_resource_name

    context = ray.get_runtime_context()
    ids = context.get_accelerator_ids().get(get_resource_name(), [])
    return context.get_node_id(), [str(i) for i in ids]


class HFReplica(RolloutReplica):
    async def launch_servers(self):
        from verl.utils.device import get_device_name

        if len(self.workers) != self.world_size:
            raise RuntimeError(f"{len(self.workers)} workers for a replica of world size {self.world_size}")
        if self.world_size != 1:
            raise ValueError(
                "the hf rollout runs one model per replica: set actor_rollout_ref.rollout.tensor_model_parallel_size"
                "=1, data_parallel_size=1 and pipeline_model_parallel_size=1 (more replicas come from more GPUs)"
            )
        infos = await asyncio.gather(*[w.__ray_call__.remote(_placement) for w in self.workers])
        server_cls = ray.remote(HFRolloutServer)
        for node_rank in range(self.nnodes):
            node_id, ids = infos[node_rank * self.gpus_per_replica_node]
            role = "reward_" if self.is_reward_model else "teacher_" if self.is_teacher_model else ""
            name = (
                server_name(self.replica_rank, node_rank, self.name_suffix)
                if not role
                else f"hf_server_{role}{self.replica_rank}_{node_rank}{self.name_suffix}"
            )
            server = server_cls.options(
                scheduling_strategy=ray.util.scheduling_strategies.NodeAffinitySchedulingStrategy(
                    node_id=node_id, soft=False
                ),
                name=name,
                max_concurrency=self.max_concurrency,
            ).remote(
                config=self.config,
                model_config=self.model_config,
                rollout_mode=self.rollout_mode,
                replica_rank=self.replica_rank,
                node_rank=node_rank,
                visible_devices=",".join(ids),
                device=get_device_name(),
            )
            self.servers.append(server)
        await asyncio.gather(*[server.init_engine.remote() for server in self.servers])
        self._server_handle = self.servers[0]
        self._server_address = f"hf://{server_name(self.replica_rank, 0, self.name_suffix)}"

    async def abort_all_requests(self, reject_request: bool = False) -> dict:
        results = await asyncio.gather(
            *[s.abort_all_requests.remote(reject_request=reject_request) for s in self.servers]
        )
        return {
            "aborted_count": sum(r["aborted_count"] for r in results),
            "request_ids": [i for r in results for i in r["request_ids"]],
            "server_results": results,
        }

    async def abort_request(self, request_id: str) -> dict:
        results = await asyncio.gather(*[s.abort_request.remote(request_id) for s in self.servers])
        for result in results:
            if result.get("aborted"):
                return result
        return {"aborted": False, "request_id": request_id, "error": "Request not found on any server"}
