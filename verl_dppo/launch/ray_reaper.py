"""The local Ray instance `verl-dppo run` starts must not outlive the launcher, even a SIGKILLed one.

`ray.init()` in the launcher starts Ray's GCS, raylet, dashboard and runtime-env agents and the workers as its
descendants. Ray's own fate-sharing stops some of them when the launcher dies without a shutdown, but not all: after
a SIGKILL of `verl-dppo run`, `ray::DashboardAgent` and `ray::RuntimeEnvAgent` stayed for minutes. A process cannot
clean up after its own SIGKILL, so `start()` spawns a small watchdog first, in a session of its own, holding the read
end of a pipe whose write end only the launcher has (not inheritable: Ray's processes do not keep it open). While the
launcher lives, the watchdog notes its descendants (pid and start time, from /proc) every `POLL_S` seconds; when the
pipe closes (the launcher exited, however), it sends SIGTERM to every noted process still alive, waits `GRACE_S`,
then SIGKILLs what is left. After a normal exit Ray has shut down already and there is nothing to end.

Shared memory: vLLM's CPU build (shm_broadcast, shm_object_storage) and verl's weight buckets create POSIX segments
(/dev/shm/psm_*, hundreds of MB) that their creator unlinks at a clean close, which a Ray actor killed at the job's
end never reaches. The watchdog sweeps only the run's own segments: the launcher marks its run (`RUN_MARKER=<id>` in
its environment, which the local Ray instance inherits, and in the job's runtime env, which every worker of the job
on a cluster gets), and while the run lives, the watchdog notes every new segment that a process of the run (a
descendant of the launcher, or a process carrying the marker) maps or holds open. After the launcher exits it keeps
noting them while the run's processes end, and unlinks each noted segment once no live process maps it (up to
`SHM_WAIT_S`). A segment another job created (a second run on the node, another job's vLLM server between two
requests) is never noted, mapped or not.

Linux only (/proc); elsewhere `start()` does nothing. With RAY_ADDRESS (a cluster the user runs) no process is ended
(`kill=False`): only the segments on this node are swept.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from typing import Any, Optional

__all__ = [
    "start",
    "mark_run",
    "descendants",
    "segments",
    "mapped_segments",
    "marked",
    "RunSegments",
    "sweep_segments",
    "RUN_MARKER",
]

POLL_S = 0.5
GRACE_S = 5.0
SHM_DIR = "/dev/shm"
SHM_PREFIX = "psm_"  # Python's multiprocessing.shared_memory names
SHM_WAIT_S = 60.0
RUN_MARKER = "VERL_DPPO_RUN_ID"
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


def segments() -> set[str]:
    """The names of the shared-memory segments of Python's naming in /dev/shm."""
    try:
        return {name for name in os.listdir(SHM_DIR) if name.startswith(SHM_PREFIX)}
    except OSError:
        return set()


def _segments_of(pid: str) -> set[str]:
    """The /dev/shm names process `pid` maps or holds open."""
    found: set[str] = set()
    marker = SHM_DIR + "/"
    try:
        with open(f"/proc/{pid}/maps", "rb") as handle:
            text = handle.read().decode(errors="replace")
    except OSError:
        return found
    for line in text.splitlines():
        at = line.find(marker)
        if at >= 0:
            found.add(line[at + len(marker) :].split()[0])
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
            if target.startswith(marker):
                found.add(target[len(marker) :].split()[0])
    except OSError:
        pass
    return found


def mapped_segments() -> set[str]:
    """The /dev/shm segment names some live process maps (or holds open)."""
    found: set[str] = set()
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            found |= _segments_of(pid)
    return found


def marked(run_id: str) -> set[int]:
    """The live processes whose environment carries `RUN_MARKER=run_id` (the run's Ray workers, vLLM's engines)."""
    needle = f"{RUN_MARKER}={run_id}".encode()
    found = set()
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/environ", "rb") as handle:
                if needle in handle.read().split(b"\0"):
                    found.add(int(pid))
        except OSError:
            continue
    return found


class RunSegments:
    """The new segments (not in `before`) that a process of one run mapped or held open, noted at each `note()`:
    the run's processes are the launcher's descendants and those carrying the run's marker."""

    def __init__(self, before: set[str], run_id: Optional[str] = None, launcher: Optional[int] = None):
        self.before, self.run_id, self.launcher = set(before), run_id, launcher
        self.noted: set[str] = set()

    def processes(self) -> set[int]:
        pids = marked(self.run_id) if self.run_id else set()
        if self.launcher is not None:
            pids |= set(descendants(self.launcher))
        pids.discard(os.getpid())
        return pids

    def note(self) -> set[str]:
        # Only a segment in /dev/shm that is neither old nor noted yet sends it through the processes' maps and
        # descriptors (tens of MB of text a scan with torch loaded in each): the watchdog polls every POLL_S, and
        # scanning at every poll took a quarter of a core for a whole run.
        if not segments() - self.before - self.noted:
            return self.noted
        for pid in self.processes():
            self.noted |= {name for name in _segments_of(str(pid)) if name.startswith(SHM_PREFIX)} - self.before
        return self.noted


def sweep_segments(run: RunSegments, wait_s: float = SHM_WAIT_S) -> list[str]:
    """Unlink the run's noted segments once no live process maps them, noting more while the run's processes end,
    for up to `wait_s`; returns the names unlinked."""
    deadline = time.monotonic() + wait_s
    removed: list[str] = []
    while True:
        mine = (run.note() & segments()) - set(removed)
        unmapped = mine - mapped_segments()
        for name in sorted(unmapped):
            try:
                os.unlink(os.path.join(SHM_DIR, name))
                removed.append(name)
            except OSError:
                pass
        if (not (mine - unmapped) and not run.processes()) or time.monotonic() >= deadline:
            return removed
        time.sleep(1.0)


def watch(launcher: int, pipe_fd: int, kill: bool = True, run_id: Optional[str] = None) -> None:
    """The watchdog's loop (in its own process): note the launcher's descendants and the run's segments until the
    pipe closes, then end those processes still alive (`kill`) and sweep the run's segments."""
    run = RunSegments(segments(), run_id=run_id, launcher=launcher)
    noted: dict[int, int] = {}
    while True:
        readable, _, _ = select.select([pipe_fd], [], [], POLL_S)
        if readable and not os.read(pipe_fd, 4096):
            break
        run.note()
        if kill:
            noted.update(descendants(launcher))
            noted = _alive(noted)
    run.launcher = None  # the launcher is gone: its pid may be reused; its processes are noted or marked
    if kill:
        _end(launcher, noted)
    sweep_segments(run)


def _end(launcher: int, noted: dict[int, int]) -> None:
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


def mark_run(config: Any) -> str:
    """A new run id, set as `RUN_MARKER` in this process's environment (a local Ray instance started after inherits
    it) and in the job's runtime env (every worker of the job, on any cluster, gets it); returns the id."""
    import uuid

    from omegaconf import open_dict

    run_id = uuid.uuid4().hex
    os.environ[RUN_MARKER] = run_id
    runtime_env = config.ray_kwargs.ray_init.runtime_env
    with open_dict(runtime_env):
        if runtime_env.get("env_vars") is None:
            runtime_env.env_vars = {}
        with open_dict(runtime_env.env_vars):
            runtime_env.env_vars[RUN_MARKER] = run_id
    return run_id


def start(kill: bool = True, run_id: Optional[str] = None) -> Optional[subprocess.Popen]:
    """Spawn the watchdog for this process (call it before `ray.init` starts a local instance; `kill=False` for a
    run on a cluster it did not start: segments only); `run_id` is the run's marker (`RUN_MARKER`) that its
    processes carry in their environment; None off Linux."""
    if not sys.platform.startswith("linux") or not os.path.isdir("/proc/self"):
        return None
    read_end, write_end = os.pipe()  # both non-inheritable (PEP 446): only the watchdog gets the read end, below
    watchdog = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys; from verl_dppo.launch.ray_reaper import watch; "
            f"watch({os.getpid()}, sys.stdin.fileno(), kill={bool(kill)}, run_id={run_id!r})",
        ],
        stdin=read_end,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    os.close(read_end)
    _WRITE_ENDS.append(write_end)  # open for the life of this process; the kernel closes it at its exit
    return watchdog
