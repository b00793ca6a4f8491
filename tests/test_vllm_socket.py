"""The colocated vLLM weight socket is named per Ray cluster (patches/vllm_rollout.py).

verl 0.9.1 names the socket a weight push binds from the Ray job id, and a Ray job id restarts at 01000000 in every
cluster: two runs on one host, each on a local Ray cluster of its own, met on one socket (the suite's vLLM tier hung
at a first push so). Checked here: the real verl classes carry the patch after the plugin loads (fresh process); the
trainer's end (verl's `ServerAdapter` name, rescoped) equals the name verl's own vLLM worker code
(`vLLMColocateWorkerExtension._get_zmq_handle`) builds from the environment the patched server hands it; two
clusters with the same job id get two names (verl's own code gives them one); another verl's name is refused.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest

from verl_dppo.patches import vllm_rollout

JOB = "01000000"


class Context:
    """Ray's runtime context as the patch reads it: a job id and the cluster's session name."""

    def __init__(self, session: str, job: str = JOB):
        self.session, self.job = session, job

    def get_job_id(self) -> str:
        return self.job

    def get_session_name(self) -> str:
        return self.session


def _verl_worker_handle(replica: int = 0, local_rank: int = 0) -> str:
    """The name verl's vLLM worker extension connects to, from its own code and this process's environment."""
    extension = pytest.importorskip("verl.workers.rollout.vllm_rollout.utils").vLLMColocateWorkerExtension
    os.environ["VERL_REPLICA_RANK"] = str(replica)
    return extension._get_zmq_handle(SimpleNamespace(model_runner=None, local_rank=local_rank))


def _server_env(context: Context, monkeypatch) -> None:
    """Run the patched `vLLMHttpServer.__init__` over a stand-in for verl's (which sets VERL_RAY_JOB_ID to the job
    id, line 143 of vllm_async_server.py) under `context`."""
    import ray

    class vLLMHttpServer:  # noqa: N801
        def __init__(self):
            os.environ[vllm_rollout.JOB_VARIABLE] = ray.get_runtime_context().get_job_id()

    monkeypatch.setattr(ray, "get_runtime_context", lambda: context)
    vllm_rollout.patch_server_job_id(SimpleNamespace(vLLMHttpServer=vLLMHttpServer))
    vLLMHttpServer()


def test_both_ends_agree_within_a_cluster_and_two_clusters_do_not_meet(monkeypatch):
    monkeypatch.setenv(vllm_rollout.JOB_VARIABLE, "unset")
    monkeypatch.setenv("VERL_REPLICA_RANK", "0")
    names = []
    for session in ("session_2026-11-25_18-03-16_404113_7184", "session_2026-11-25_18-03-16_401870_7185"):
        context = Context(session)
        # verl's trainer end, as ServerAdapter.__init__ builds it (vllm_rollout.py:141), then rescoped
        verl_name = f"ipc:///tmp/rl-colocate-zmq-{JOB}-replica-1-rank-0.sock"
        trainer_end = vllm_rollout.rescoped_handle(verl_name, context)
        _server_env(context, monkeypatch)
        assert trainer_end == _verl_worker_handle(replica=1), "the two ends of one cluster's socket differ"
        names.append(trainer_end)
    assert names[0] != names[1], names
    assert all(len(name) - len("ipc://") < 100 for name in names)  # a Unix socket path holds 107 bytes
    # verl's own names: one socket for both clusters (the defect)
    monkeypatch.setenv(vllm_rollout.JOB_VARIABLE, JOB)
    assert _verl_worker_handle(replica=1) == f"ipc:///tmp/rl-colocate-zmq-{JOB}-replica-1-rank-0.sock"


def test_another_verls_socket_name_is_refused_naming_the_patch():
    with pytest.raises(RuntimeError, match="patches/vllm_rollout.py.*does not know this verl"):
        vllm_rollout.rescoped_handle("ipc:///tmp/rl-colocate-zmq-replica-0-rank-0.sock", Context("session_a"))


def test_a_server_that_sets_another_job_variable_is_refused(monkeypatch):
    import ray

    class vLLMHttpServer:  # noqa: N801
        def __init__(self):
            os.environ[vllm_rollout.JOB_VARIABLE] = "something-else"

    monkeypatch.setenv(vllm_rollout.JOB_VARIABLE, "unset")
    monkeypatch.setattr(ray, "get_runtime_context", lambda: Context("session_a"))
    vllm_rollout.patch_server_job_id(SimpleNamespace(vLLMHttpServer=vLLMHttpServer))
    with pytest.raises(RuntimeError, match="does not know this verl"):
        vLLMHttpServer()


def test_the_plugin_patches_verls_real_classes_in_a_fresh_process():
    pytest.importorskip("vllm")
    code = textwrap.dedent("""
        import verl  # loads the plugin through verl.plugins
        from verl.workers.rollout.vllm_rollout import vllm_async_server, vllm_rollout
        from verl_dppo.patches._import_hook import _PATCHED
        print(getattr(vllm_rollout.ServerAdapter.__init__, _PATCHED, False),
              getattr(vllm_async_server.vLLMHttpServer.__init__, _PATCHED, False))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-2:] == ["True", "True"], out.stdout[-500:]
