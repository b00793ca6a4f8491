"""How a command that launches `verl-dppo run` children follows and ends them (`verl-dppo mismatch`, `verl-dppo
study`).

- `follow_launch`: the launch's console goes to a file, and the phase the launch has reached is read off it as it is
  written (`verl-dppo mismatch` says each phase as it comes).
- `run_launch`: `subprocess.run` for a launch (`verl-dppo study`, one run after another).

Both end their launch when the command itself is ended: by an interrupt (as `subprocess.run` does), and by SIGTERM
(`kill`) or SIGHUP (a closed terminal or ssh session), which reach the command alone. Without that, a `kill` of the
study left its current run training in the background, the run's Ray instance with it. The launch is sent SIGTERM
(a `verl-dppo run` dies at once; its watchdog, `verl_dppo.launch.ray_reaper`, then ends its Ray instance), and the
command then ends as the signal would have ended it.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import threading
import time
from typing import Any, Callable, Sequence

__all__ = ["LAUNCH_PHASES", "follow_launch", "run_launch", "launches_end_with_this_process", "Terminated"]

LAUNCH_PHASES = (  # phase -> the line of a launch's console that says it has begun
    ("rollout", re.compile(r"Training Progress:")),  # verl's fit loop opened its progress bar: a step's rollout first
    ("update", re.compile(r"verl-dppo \S+ in effect: ")),  # the plugin's loss announces its values at its first call
)
"""After "build" (the launch itself: the model and data where missing, Ray, verl's workers, the rollout server)."""
POLL_S = 0.5
"""How often `follow_launch` reads the launch's console."""


END_S = 30.0
"""How long a launch has to end after SIGTERM (a `verl-dppo run` dies at once; its watchdog then ends its Ray
instance) before it is SIGKILLed."""
ENDING_SIGNALS = ("SIGTERM", "SIGHUP")
"""What ends a command that launches runs (`kill`, a closed terminal or ssh session) besides an interrupt."""


class Terminated(BaseException):
    """Raised in the main thread, within `launches_end_with_this_process`, by SIGTERM or SIGHUP."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


@contextlib.contextmanager
def launches_end_with_this_process():
    """Within: SIGTERM and SIGHUP raise `Terminated` instead of ending this process at once, so that a launch it
    started (a child `verl-dppo run`, which no signal to this process alone reaches) can be ended first; on leaving,
    the default handlers come back, and a `Terminated` that got out ends this process by its signal, as the signal
    would have. A signal this process ignores or handles itself is left alone, and so is any thread but the main one
    (where Python delivers signals)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def raise_terminated(signum, frame):
        for number in numbers:  # a second signal does not cut short the launch's ending
            signal.signal(number, signal.SIG_IGN)
        raise Terminated(signum)

    numbers = [getattr(signal, name) for name in ENDING_SIGNALS if hasattr(signal, name)]
    # only where the signal would end this process: one ignored (SIGHUP under nohup) or handled stays so
    numbers = [number for number in numbers if signal.getsignal(number) == signal.SIG_DFL]
    for number in numbers:
        signal.signal(number, raise_terminated)
    try:
        yield
    except Terminated as terminated:
        for number in numbers:
            signal.signal(number, signal.SIG_DFL)
        os.kill(os.getpid(), terminated.signum)  # ends this process as the signal would have
        raise
    finally:
        for number in numbers:
            signal.signal(number, signal.SIG_DFL)


def _end(process: subprocess.Popen) -> None:
    """SIGTERM the launch, wait up to END_S for it, then SIGKILL it."""
    try:
        process.terminate()
        process.wait(timeout=END_S)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def run_launch(command: Sequence[str], stdout: Any) -> int:
    """`subprocess.run(command)` with its output and errors to `stdout`, the exit status returned, for a command that
    launches runs one after another (`verl-dppo study`): the launch also ends when this process is terminated
    (SIGTERM, SIGHUP), not only when it is interrupted."""
    with launches_end_with_this_process():
        process = subprocess.Popen(list(command), stdout=stdout, stderr=subprocess.STDOUT)
        try:
            return process.wait()
        except BaseException:
            _end(process)
            raise


def follow_launch(command: Sequence[str], log: str, env: dict, on_phase: Callable[[str], None]) -> int:
    """Run `command` (a `verl-dppo run`) with its console into the file `log`, calling `on_phase(name)` once per
    phase ("build" at once, then each of LAUNCH_PHASES as its line reaches the file); returns the exit status. The
    launch is ended if this process is interrupted or terminated (`run_launch`)."""
    with launches_end_with_this_process():
        with open(log, "w") as handle:
            process = subprocess.Popen(list(command), stdout=handle, stderr=subprocess.STDOUT, env=env)
        try:
            on_phase("build")
            pending = list(LAUNCH_PHASES)
            with open(log, errors="replace") as reader:
                tail = ""
                while True:
                    ended = process.poll() is not None
                    tail += reader.read()
                    while pending and any(pattern.search(tail) for _, pattern in pending):
                        name, _ = pending.pop(0)  # in order: a phase whose line was missed is said before the next
                        on_phase(name)
                    tail = tail[-512:]  # a marker cut between two reads is found in the next
                    if ended:
                        return process.returncode
                    time.sleep(POLL_S)
        except BaseException:
            _end(process)
            raise
