"""The CPU platform the plugin ships (verl_dppo.plugin.cpu_platform) and its patches, in fresh processes.

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
    from verl_dppo.plugin import cpu_platform  # imports verl, which loads the plugin, which needs this module
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
    assert seen == {"registered": "CPUPlatform", "device": "cpu", "backend": "cpu:gloo", "ray": {"num_cpus": 2},
                    "engine_device": "cuda"}


def test_without_the_setting_nothing_changes():
    seen = probe("verl-first")
    assert seen["registered"] == "CPUPlatform"  # registered, not selected
    assert seen["device"] != "cpu" or seen["backend"] != "cpu:gloo"
    assert seen["engine_device"] is None
