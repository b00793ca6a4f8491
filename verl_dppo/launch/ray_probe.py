"""Is a Ray cluster there, and what does it hold? Asked with a deadline, never by a call that can hang.

`ray.init(address=...)` retries a silent address for minutes, and no timeout of Ray's covers it. So: a TCP connect
to `host:port` first (an instant "nothing listens there"), then the Ray call itself in a child process that is
killed at the deadline (`python -m verl_dppo.launch.ray_probe`), which prints one JSON line. The worker's probe is
`verl_dppo.launch.install_probe.plugin_state`: this module imports no command, so `doctor` and `run` can import it.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from typing import Optional

from verl_dppo.errors import UsageError

__all__ = ["RayUnreachable", "check_address", "run_probe"]


class RayUnreachable(UsageError):
    """No Ray cluster answers at the address given; the message names it and what to do."""


def _host_port(address: str) -> Optional[tuple[str, int]]:
    """`host:port` or `ray://host:port` -> (host, port); None for `auto`, `local` and other forms Ray resolves."""
    bare = address.split("://", 1)[-1].rstrip("/")
    host, sep, port = bare.rpartition(":")
    if not sep or not port.isdigit() or not host:
        return None
    return host.strip("[]"), int(port)


def check_address(address: str, flag: str, timeout_s: float = 5.0) -> None:
    """Raise RayUnreachable unless something accepts a TCP connection at `address` within `timeout_s`."""
    target = _host_port(address)
    if target is None:
        return
    try:
        with socket.create_connection(target, timeout=timeout_s):
            return
    except OSError as error:
        reason = "timed out" if isinstance(error, socket.timeout) else (error.strerror or str(error))
        raise RayUnreachable(
            f"{flag}={address}: no Ray cluster answers there ({reason}); start one with `ray start --head` on that "
            f"node, or fix the address"
        ) from None


def run_probe(kind: str, address: Optional[str], timeout_s: float) -> dict:
    """Run `kind` ("worker": the plugin inside a Ray worker; "resources": the cluster's CPUs/GPUs) in a child
    process, at most `timeout_s` seconds. Raises RayUnreachable with Ray's own first line when it fails."""
    command = [sys.executable, "-m", "verl_dppo.launch.ray_probe", kind, address or ""]
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        stdout, stderr = process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        try:  # the probe's own process group: it and any Ray process it started
            os.killpg(process.pid, signal.SIGKILL)
        except OSError:
            pass
        process.communicate()
        where = f"the Ray cluster at {address}" if address else "a local Ray instance"
        raise RayUnreachable(
            f"{where} did not answer within {timeout_s:g} s; check that it is up (`ray status`) and reachable from here"
        ) from None
    lines = [line for line in stdout.splitlines() if line.startswith("{")]
    if process.returncode == 0 and lines:
        return json.loads(lines[-1])
    detail = [line.strip() for line in (stderr or stdout).splitlines() if line.strip()]
    errors = [line for line in detail if "Error" in line or "error" in line]
    reason = (errors or detail or [f"exit code {process.returncode}"])[-1]
    where = f"the Ray cluster at {address}" if address else "a local Ray instance"
    raise RayUnreachable(f"cannot reach {where}: {reason[:300]}")


def _main(kind: str, address: str) -> None:
    import ray

    kwargs = {"address": address} if address else {"num_cpus": 1, "include_dashboard": False}
    ray.init(log_to_driver=False, configure_logging=False, logging_level="ERROR", **kwargs)
    try:
        if kind == "worker":
            from verl_dppo.launch.install_probe import plugin_state

            remote = ray.remote(num_cpus=0)(plugin_state)
            result = ray.get(remote.remote())
        else:
            resources = ray.cluster_resources()
            result = {
                "GPU": resources.get("GPU", 0.0),
                "CPU": resources.get("CPU", 0.0),
                "nodes": len([node for node in ray.nodes() if node.get("Alive")]),
            }
    finally:
        ray.shutdown()
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    _main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "")
