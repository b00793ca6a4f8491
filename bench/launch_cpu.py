"""Where one launch of the e2e pool spends its CPU: each process of the run (the driver, verl's task runner, its
workers, TransferQueue's actors, Ray's own), by the CPU time it had used when last seen.

The pool's launches saturate both cores, so the suite's time follows the CPU its processes use (docs/development.md).
This runs one launch as the suite runs it (`DPPO_FULL_LOOP_ONLY=RUN`, pytest on the tier's file) and samples every
process below pytest with psutil (every --interval seconds: a process's last fraction of a second before it exits is
not seen). Processes are named by Ray's actor title (`ray::TaskRunnerV1`) or their command line.

--imports: the launch's processes run with PYTHONPROFILEIMPORTTIME=1 (Python's -X importtime; Ray forwards its
workers' lines to the launch's log) and a second table gives, for each process of the run, the seconds of its
imports in all and of the costliest packages in them, each where the process first imported it.

    .venv/bin/python bench/launch_cpu.py [--run sync-dppo_topk_kl] [--tier tests/e2e/test_full_loop.py] [-k EXPR]
                                         [--imports]
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("torch", "torch._dynamo", "transformers", "ray", "vllm", "megatron.core")
"""The packages the import table shows: each over a second in some process of a CPU launch (2026-11-30)."""
PREFIX = re.compile(r"^(?:\x1b\[\d+m)?\((?:(\w+) )?pid=(\d+)\)")
"""Ray's prefix on a worker's forwarded line: the actor's class once the process is one, its pid always."""
IMPORT_LINE = re.compile(r"import time:\s+\d+ \|\s+(\d+) \|( +)(\S+)$")


def name_of(process: psutil.Process) -> str:
    command = process.cmdline()
    if command and command[0].startswith("ray::"):
        return command[0].split()[0]
    words = [Path(word).name if "/" in word else word for word in command[:4]]
    return " ".join(words)[:60] or process.name()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", default="sync-dppo_topk_kl", help="the pool's launch (DPPO_FULL_LOOP_ONLY)")
    parser.add_argument("--tier", default="tests/e2e/test_full_loop.py")
    parser.add_argument(
        "-k",
        help="pytest's -k (default: the tier's every test; those reading runs other than "
        "--run skip, as with DPPO_FULL_LOOP_ONLY)",
    )
    parser.add_argument("--interval", type=float, default=0.5)
    parser.add_argument("--imports", action="store_true", help="also the seconds each process spends importing")
    args = parser.parse_args()
    env = dict(os.environ, DPPO_FULL_LOOP_ONLY=args.run, **({"PYTHONPROFILEIMPORTTIME": "1"} if args.imports else {}))
    basetemp = Path(tempfile.mkdtemp(prefix="launch-cpu-"))
    command = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-m",
        "e2e",
        args.tier,
        *(("-k", args.k) if args.k else ()),
        "-p",
        "no:cacheprovider",
        f"--basetemp={basetemp}",
    ]
    log = tempfile.TemporaryFile("w+")  # not a pipe: a failing launch's output would fill it and stop pytest
    start = time.perf_counter()
    pytest = psutil.Popen(command, cwd=REPO, env=env, stdout=log, stderr=log)
    seen: dict[int, tuple[str, float]] = {}
    while pytest.poll() is None:
        for process in [pytest, *pytest.children(recursive=True)]:
            try:
                with process.oneshot():
                    times = process.cpu_times()
                    seen[process.pid] = (name_of(process), times.user + times.system)
            except psutil.Error:  # gone between the listing and the reading
                continue
        time.sleep(args.interval)
    wall = time.perf_counter() - start
    log.seek(0)
    output = log.read()
    launch = next((line.strip() for line in output.splitlines() if line.strip().startswith(f"{args.run} ")), "")
    by_name: dict[str, list[float]] = {}
    for name, seconds in seen.values():
        by_name.setdefault(name, []).append(seconds)
    total = sum(seconds for _, seconds in seen.values())
    print(
        f"{args.run}: pytest {wall:.0f} s, the launch {launch.split()[-2] if launch else '?'} s; CPU of every "
        f"process seen: {total:.1f} s"
    )
    print("| process | count | CPU (s) | share |\n|---|---|---|---|")
    for name, times in sorted(by_name.items(), key=lambda item: -sum(item[1])):
        if sum(times) >= 0.5:
            print(f"| `{name}` | {len(times)} | {sum(times):.1f} | {sum(times) / total:.0%} |")
    if args.imports:
        import_table(basetemp / "lanes0" / args.run / f"{args.run}.log")  # the launch's folder kept to read
    else:
        shutil.rmtree(basetemp, ignore_errors=True)
    if pytest.returncode != 0:
        print(output[-3000:])
        raise SystemExit(f"pytest exited {pytest.returncode}")


def import_table(launch_log: Path) -> None:
    """Per process of the launch (a Ray actor by its class and pid; the driver's own lines carry no prefix): its
    imports' seconds (the top-level ones summed) and each of PACKAGES' where it was first imported."""
    totals: dict[str, float] = {}
    packages: dict[str, dict[str, float]] = {}
    actors: dict[str, str] = {}
    for line in launch_log.read_text(errors="replace").splitlines():
        prefix, imported = PREFIX.match(line), IMPORT_LINE.search(line)
        if prefix is not None and prefix.group(1):
            actors.setdefault(prefix.group(2), prefix.group(1))
        if imported is None or not line[prefix.end() if prefix else 0 :].lstrip("\x1b[0m ").startswith("import time:"):
            continue
        process = prefix.group(2) if prefix else "driver"
        cumulative, indent, package = imported.groups()
        seconds = int(cumulative) / 1e6
        if len(indent) == 1:
            totals[process] = totals.get(process, 0.0) + seconds
        if package in PACKAGES:
            packages.setdefault(process, {}).setdefault(package, seconds)
    print(f"\nimports (seconds; {launch_log}):")
    print(f"| process | all | {' | '.join(PACKAGES)} |\n|---|---|{'---|' * len(PACKAGES)}")
    for process, total in sorted(totals.items(), key=lambda item: -item[1]):
        cells = [f"{packages[process][name]:.1f}" if name in packages.get(process, {}) else "-" for name in PACKAGES]
        name = "the driver (main_ppo)" if process == "driver" else f"{actors.get(process, 'a Ray worker')} {process}"
        print(f"| {name} | {total:.1f} | {' | '.join(cells)} |")


if __name__ == "__main__":
    main()
