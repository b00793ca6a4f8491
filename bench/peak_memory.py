"""The benchmarks' memory probe (bench_topk.py, bench_troll.py): the extra peak memory of a block, measured in a child
process that starts clean.

On CPU the peak is the process's resident-set high-water mark (VmHWM), reset to the current RSS before the block
(/proc/self/clear_refs). That measures something only if freed memory leaves the process: glibc keeps freed heap
memory resident and raises its mmap threshold (up to 32 MiB) after each large free, so in a process that has just
freed a 2.3 GB baseline, a block's chunk-sized allocations reuse that memory and the high-water mark does not move
(bench_topk.py reported no memory at all that way). `child_json` therefore runs each measurement in its own child process
with MALLOC_MMAP_THRESHOLD_=65536: every allocation above 64 KiB is mmap'd and unmapped on free, and the
high-water mark is the live peak. On CUDA: torch.cuda.max_memory_allocated over the block.
"""

from __future__ import annotations

import gc
import json
import os
import re
import subprocess
import sys

import torch

MMAP_THRESHOLD = "65536"


def _rss_bytes(field: str) -> int:
    with open("/proc/self/status") as status:
        match = re.search(rf"^{field}:\s+(\d+) kB", status.read(), re.M)
    return int(match.group(1)) * 1024


class PeakMemory:
    """Extra peak memory of a block, in bytes (CUDA allocator, or the CPU process's RSS high-water mark)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.extra = 0

    def __enter__(self):
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
        else:
            with open("/proc/self/clear_refs", "w") as clear:
                clear.write("5")  # reset VmHWM to the current RSS
            self.base = _rss_bytes("VmRSS")
        return self

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            self.extra = torch.cuda.max_memory_allocated() - self.base
        else:
            self.extra = _rss_bytes("VmHWM") - self.base


def check_allocator(device: torch.device) -> None:
    """Refuse a CPU memory measurement in a process whose allocator keeps freed memory (see the module docstring)."""
    if device.type == "cpu" and os.environ.get("MALLOC_MMAP_THRESHOLD_") != MMAP_THRESHOLD:
        raise SystemExit(
            f"a CPU memory measurement needs MALLOC_MMAP_THRESHOLD_={MMAP_THRESHOLD}: run it through "
            "child_json (the benchmark's own entry point does)"
        )


def child_json(extra_args: list[str], device: str) -> dict:
    """Run this script again with `extra_args` in a fresh child process (on CPU with every allocation above 64 KiB
    returned to the system on free); returns the JSON object on the last line of its stdout."""
    env = dict(os.environ)
    if torch.device(device).type == "cpu":
        env["MALLOC_MMAP_THRESHOLD_"] = MMAP_THRESHOLD
    child = subprocess.run([sys.executable, *sys.argv, *extra_args], env=env, capture_output=True, text=True)
    if child.returncode != 0:
        raise SystemExit(
            f"the measurement child {' '.join(extra_args)} failed (exit {child.returncode}):\n" + child.stderr[-3000:]
        )
    return json.loads(child.stdout.strip().splitlines()[-1])
