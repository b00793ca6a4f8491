"""Patch of verl's colocated vLLM weight socket: named per Ray cluster, not only per Ray job.

Which verl code: `verl.workers.rollout.vllm_rollout.vllm_rollout.ServerAdapter.__init__` names the trainer side's
ZMQ socket `ipc:///tmp/rl-colocate-zmq-{job_id}-replica-{r}-rank-{k}.sock` from `ray.get_runtime_context().get_job_id()`;
`vllm_async_server.vLLMHttpServer.__init__` puts the same job id in `VERL_RAY_JOB_ID`, from which the vLLM worker
(`vLLMColocateWorkerExtension._get_zmq_handle`) names its end. The weight push binds the first, vLLM connects to the
second.
Why: a Ray job id is a counter of its Ray cluster: the first job of every cluster is `01000000`. Two runs on one host,
each on a local Ray cluster of its own (two `verl-dppo run` launches or two `main_ppo` launches without RAY_ADDRESS,
the suite's two vLLM lanes), name the same socket path; the second bind takes the path from the first, and a weight
push reaches the other run's vLLM or waits forever (seen: a run of the suite's vLLM tier hung at its first push,
started just after the other lane's run; docs/development.md).
What the patch does: both ends use `scoped_job_id()`, the job id and a token of the Ray session
(`get_session_name()`, one per cluster): a cluster's two ends still agree, two clusters no longer meet. verl's format
is checked where it is rewritten: another verl's name raises, naming this patch.
What would make it unnecessary: verl naming the socket by session and job (or binding a path it chose uniquely and
handing it to vLLM with the update request, as it does for delta updates).
"""

from __future__ import annotations

import hashlib
import os
from typing import Any

from verl_dppo.patches._import_hook import patch_once

__all__ = [
    "JOB_VARIABLE",
    "SOCKET_PREFIX",
    "patch_server_adapter",
    "patch_server_job_id",
    "rescoped_handle",
    "scoped_job_id",
]

SOCKET_PREFIX = "ipc:///tmp/rl-colocate-zmq-"
JOB_VARIABLE = "VERL_RAY_JOB_ID"


def scoped_job_id(context: Any = None) -> str:
    """The Ray job id and 8 hex digits of the Ray session's name: the same in every process of one cluster's job,
    different between clusters (whose job ids restart at 01000000)."""
    if context is None:
        import ray

        context = ray.get_runtime_context()
    session = hashlib.sha1(context.get_session_name().encode()).hexdigest()[:8]
    return f"{context.get_job_id()}-{session}"


def rescoped_handle(handle: str, context: Any = None) -> str:
    """verl's socket name with its job id replaced by `scoped_job_id()`."""
    if context is None:
        import ray

        context = ray.get_runtime_context()
    verl_prefix = f"{SOCKET_PREFIX}{context.get_job_id()}-replica-"
    if not handle.startswith(verl_prefix):
        raise RuntimeError(
            f"verl-dppo patches/vllm_rollout.py: verl named its vLLM weight socket {handle!r}, not "
            f"'{verl_prefix}...' as verl 0.9.1 does; the patch that keeps two Ray clusters on one host apart does "
            f"not know this verl"
        )
    return f"{SOCKET_PREFIX}{scoped_job_id(context)}-replica-" + handle[len(verl_prefix) :]


def patch_server_adapter(module: Any) -> None:
    """ServerAdapter.__init__ (the trainer side): its `zmq_handle` rescoped."""

    def make(original):
        def __init__(self, *args, **kwargs):
            original(self, *args, **kwargs)
            self.zmq_handle = rescoped_handle(self.zmq_handle)

        return __init__

    patch_once(module.ServerAdapter, "__init__", make)


def patch_server_job_id(module: Any) -> None:
    """vLLMHttpServer.__init__ (the vLLM side, before it starts vLLM's workers in `launch_server`): the job id it
    hands them in VERL_RAY_JOB_ID, scoped."""

    def make(original):
        def __init__(self, *args, **kwargs):
            original(self, *args, **kwargs)
            import ray

            context = ray.get_runtime_context()
            if os.environ.get(JOB_VARIABLE) != context.get_job_id():
                raise RuntimeError(
                    f"verl-dppo patches/vllm_rollout.py: vLLMHttpServer set {JOB_VARIABLE}="
                    f"{os.environ.get(JOB_VARIABLE)!r}, not the Ray job id as verl 0.9.1 does; the patch that keeps "
                    f"two Ray clusters on one host apart does not know this verl"
                )
            os.environ[JOB_VARIABLE] = scoped_job_id(context)

        return __init__

    patch_once(module.vLLMHttpServer, "__init__", make)
