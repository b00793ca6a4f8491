"""The CPU platform the plugin ships (verl_dppo.rehearsal.platform) and its patches, in fresh processes.

`VERL_PLATFORM=cpu` (verl's own override) is the one setting: verl's `get_platform()` then answers `cpu`, Ray
resources as CPUs, gloo; the plugin points verl's engine registry at the FSDP engine, verl's process-group helper
stops building a duplicate `cpu:gloo,cpu:gloo` backend, and the resource check counts CPUs. Without the setting
nothing changes. Importing the module before verl (as a launcher does) must work too.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

PROBE = r"""
import json, os, sys
if sys.argv[1] == "module-first":
    from verl_dppo.rehearsal import platform as cpu_platform  # imports verl, which loads the plugin, which needs this module
import verl
from verl.plugin.platform import PlatformRegistry, get_platform
import verl.utils.distributed as distributed
captured = {}
def fake_init_process_group(backend=None, **kwargs):
    captured["backend"] = backend
import torch.distributed
torch.distributed.is_initialized = lambda: False
torch.distributed.init_process_group = fake_init_process_group
distributed.initialize_global_process_group_ray()
platform = get_platform()
print(json.dumps({"registered": PlatformRegistry.get("cpu").__name__, "device": platform.device_name,
                  "backend": captured["backend"], "ray": platform.ray_resource_options(2),
                  "engine_device": os.environ.get("VERL_ENGINE_DEVICE")}))
"""


def probe(*args, **env):
    full = {k: v for k, v in os.environ.items() if not k.startswith("VERL_")}
    full.update(env)
    out = subprocess.run([sys.executable, "-c", PROBE, *args], capture_output=True, text=True, env=full, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_verl_platform_cpu_selects_the_plugin_platform_in_a_fresh_process():
    """Also with the platform module imported before verl, as a launcher does."""
    seen = probe("module-first", VERL_PLATFORM="cpu")
    assert seen == {
        "registered": "CPUPlatform",
        "device": "cpu",
        "backend": "cpu:gloo",
        "ray": {"num_cpus": 2},
        "engine_device": "cuda",
    }


def test_without_the_setting_nothing_changes():
    seen = probe("verl-first")
    assert seen["registered"] == "CPUPlatform"  # registered, not selected
    assert seen["device"] != "cpu" or seen["backend"] != "cpu:gloo"
    assert seen["engine_device"] is None


PORT_PROBE = r"""
import json, sys
import verl  # loads the plugin, which patches the module below on its import
import verl.single_controller.ray.base as base
scan = base.get_master_addr_port._function  # verl's own port scan, without Ray
seen = []
class _Remote:
    def options(self, **_):
        return self
    def remote(self, master_port_range=None):
        seen.append(master_port_range)
        return scan(master_port_range=master_port_range)
base.get_master_addr_port = _Remote()
base.ray.get = lambda value: value
ports = []
for _ in range(int(sys.argv[1])):
    group = object.__new__(base.RayWorkerGroup)
    group._master_addr = group._master_port = None
    group._get_master_addr_port(pg=None)
    ports.append(int(group._master_port))
print(json.dumps({"ranges": seen, "ports": ports}))
"""


def _ephemeral_ports() -> tuple[int, int]:
    try:
        low, high = open("/proc/sys/net/ipv4/ip_local_port_range").read().split()
        return int(low), int(high)
    except OSError:
        return 32768, 60999


def test_a_cpu_run_takes_its_master_ports_outside_the_ephemeral_range():
    """verl picks a worker group's MASTER_PORT with bind(0) and closes it; rank 0 binds it seconds later. On the CPU
    platform the plugin hands verl's own scan a range the kernel hands no other socket (an EADDRINUSE seen once with
    two jobs on one machine). Random starts: two picks differ. Without the platform, verl's pick is unchanged."""
    from verl_dppo.rehearsal.patches.cpu_resources import MASTER_PORTS

    def run(n, **env):
        full = {k: v for k, v in os.environ.items() if not k.startswith("VERL_")}
        full.update(env)
        out = subprocess.run(
            [sys.executable, "-c", PORT_PROBE, str(n)], capture_output=True, text=True, env=full, timeout=300
        )
        assert out.returncode == 0, out.stderr[-3000:]
        return json.loads(out.stdout.strip().splitlines()[-1])

    cpu = run(4, VERL_PLATFORM="cpu")
    low, high = _ephemeral_ports()
    assert None not in cpu["ranges"], f"verl's bind(0) pick on the CPU platform: {cpu}"
    for (start, end), port in zip(cpu["ranges"], cpu["ports"]):
        assert MASTER_PORTS[0] <= start < end == MASTER_PORTS[1] and start <= port < end
        assert not low <= port <= high and port >= 20000
    assert len(set(cpu["ports"])) > 1
    default = run(1)
    assert default["ranges"] == [None]  # verl's bind(0): a port of the ephemeral range


def test_transformers_torchvision_fallback_notice_is_filtered_on_the_cpu_platform(monkeypatch):
    """Issue 32.5: a vLLM-CPU run printed transformers' "`Qwen2VLImageProcessor` requires torchvision (not installed)"
    six times (torchvision is left out on purpose); on the CPU platform it is filtered, any other message kept."""
    import logging

    from verl_dppo.rehearsal.patches.vllm_cpu import quiet_torchvision_fallback

    monkeypatch.setenv("VERL_PLATFORM", "cpu")
    quiet_torchvision_fallback()
    quiet_torchvision_fallback()  # once only
    logger = logging.getLogger("transformers.utils.import_utils")
    assert len(logger.filters) == 1
    seen = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    logger.addHandler(handler)
    try:
        logger.warning("`Qwen2VLImageProcessor` requires torchvision (not installed); falling back to `X`")
        logger.warning("another transformers notice")
    finally:
        logger.removeHandler(handler)
    assert seen == ["another transformers notice"]
