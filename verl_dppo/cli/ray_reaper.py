"""The local Ray instance `verl-dppo run` starts must not outlive the launcher, even a SIGKILLed one.

`ray.init()` in the launcher starts Ray's GCS, raylet, dashboard and runtime-env agents and the workers as its
descendants. Ray's own fate-sharing stops some of them when the launcher dies without a shutdown, but not all: after
a SIGKILL of `verl-dppo run`, `ray::DashboardAgent` and `ray::RuntimeEnvAgent` stayed for minutes. A process cannot
clean up after its own SIGKILL, so `start()` spawns a small watchdog first, in a session of its own, holding the read
end of a pipe whose write end only the launcher has (not inheritable: Ray's processes do not keep it open). While the
launcher lives, the watchdog notes its descendants (pid and start time, from /proc) every `POLL_S` seconds; when the
pipe closes (the launcher exited, however), it sends SIGTERM to every noted process still alive, waits `GRACE_S`,
then SIGKILLs what is left. After a normal exit Ray has shut down already and there is nothing to end.

Linux only (/proc); elsewhere `start()` does nothing. Not used with RAY_ADDRESS (a cluster the user runs).
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from typing import Optional

__all__ = ["start", "descendants"]

POLL_S = 0.5
GRACE_S = 5.0
_WRITE_ENDS: list[int] = []


def _stat(pid: int) -> Optional[tuple[int, int]]:
    """(parent pid, start time in clock ticks) of a live process (a zombie is not), or None."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            fields = handle.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if fields[0] in (b"Z", b"X") else (int(fields[1]), int(fields[19]))


def descendants(root: int) -> dict[int, int]:
    """pid -> start time of every live descendant of `root`."""
    children: dict[int, list[tuple[int, int]]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            stat = _stat(int(name))
            if stat is not None:
                children.setdefault(stat[0], []).append((int(name), stat[1]))
    found: dict[int, int] = {}
    todo = [root]
    while todo:
        for pid, started in children.get(todo.pop(), ()):
            if pid not in found:
                found[pid] = started
                todo.append(pid)
    return found


def _alive(processes: dict[int, int]) -> dict[int, int]:
    return {pid: started for pid, started in processes.items() if (_stat(pid) or (0, None))[1] == started}


def _signal(processes: dict[int, int], number: int) -> None:
    for pid in processes:
        try:
            os.kill(pid, number)
        except OSError:
            pass


def watch(launcher: int, pipe_fd: int) -> None:
    """The watchdog's loop (in its own process): note the launcher's descendants until the pipe closes, then end
    those still alive."""
    noted: dict[int, int] = {}
    while True:
        readable, _, _ = select.select([pipe_fd], [], [], POLL_S)
        if readable and not os.read(pipe_fd, 4096):
            break
        noted.update(descendants(launcher))
        noted = _alive(noted)
    noted.update(descendants(launcher))  # a launcher that exited normally may still have children
    noted.pop(os.getpid(), None)  # the watchdog is one of them
    left = _alive(noted)
    if not left:
        return
    _signal(left, signal.SIGTERM)
    deadline = time.monotonic() + GRACE_S
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = _alive(left)
    _signal(left, signal.SIGKILL)


def start() -> Optional[subprocess.Popen]:
    """Spawn the watchdog for this process (call it before `ray.init` starts a local instance); None off Linux."""
    if not sys.platform.startswith("linux") or not os.path.isdir("/proc/self"):
        return None
    read_end, write_end = os.pipe()  # both non-inheritable (PEP 446): only the watchdog gets the read end, below
    watchdog = subprocess.Popen(
        [sys.executable, "-c", "import sys; from verl_dppo.cli.ray_reaper import watch; "
         f"watch({os.getpid()}, sys.stdin.fileno())"],
        stdin=read_end, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )
    os.close(read_end)
    _WRITE_ENDS.append(write_end)  # open for the life of this process; the kernel closes it at its exit
    return watchdog
