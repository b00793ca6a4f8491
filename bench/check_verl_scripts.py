"""`verl-dppo check` on every one of verl's example scripts, switched by the README's "From GRPO" lines.

    git clone --branch v0.9.1 --depth 1 https://github.com/volcengine/verl /tmp/verl-0.9.1
    .venv/bin/python bench/check_verl_scripts.py /tmp/verl-0.9.1/examples [--out table.md] [--jobs 2]

Each `*.sh` under the folder runs under bash as it is, with `python`, `python3`, `uv`, `torchrun` and `ray` on PATH
replaced by a shim: a call whose words name `main_ppo` (or another `verl.` entry point, which check answers in one
line) becomes `verl-dppo check <the call as the script made it> <the README's lines>`, its exit code and lines
recorded (its every line in `--json`); every other call (a data preprocessor, a checkpoint converter, `ray start`) does nothing and succeeds. So
the script's own variables, loops and `$@` fill the command as they would on the cluster, and nothing is launched or
downloaded. Prints one row per script (the exit codes of its checks, its first `problem` line, else its first `not here`) and the count of
scripts by exit code; a script with no such call is counted apart. Whether each verdict is right is for the reader
of the table to judge against the script: exit 3 (the data or model is not on this machine) is what a right command
gets here.

verl's examples are not part of its wheel or its PyPI sdist: the folder comes from a checkout of verl.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import json
import os
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from test_cli_errors import FROM_GRPO  # noqa: E402  (the README's lines, as the tests read them)

SHIMMED = ("python", "python3", "uv", "torchrun", "ray")

SHIM = r"""#!/usr/bin/env bash
# bench/check_verl_scripts.py: a call that names main_ppo (or a verl. entry point) is checked, any other does nothing.
for word in "$@"; do
  case "$word" in
    *main_ppo*|verl.*)
      mapfile -t lines < "$DPPO_SWITCH_LINES"
      output=$("$DPPO_CHECK" check "$(basename "$0")" "$@" "${lines[@]}" 2>&1)
      rc=$?
      printf '%s\n' "$rc" >> "$DPPO_RESULTS/rc"
      printf '%s\n' "$output" >> "$DPPO_RESULTS/lines"
      exit 0;;
  esac
done
exit 0
"""


def shim_folder(folder: Path) -> Path:
    shims = folder / "bin"
    shims.mkdir()
    for name in SHIMMED:
        path = shims / name
        path.write_text(SHIM)
        path.chmod(0o755)
    return shims


def check_script(script: Path, shims: Path, lines_file: Path, work: Path, timeout_s: int) -> dict:
    results = Path(tempfile.mkdtemp(dir=work))
    env = {
        **os.environ,
        "PATH": f"{shims}:{os.environ['PATH']}",
        "DPPO_SWITCH_LINES": str(lines_file),
        "DPPO_RESULTS": str(results),
        "DPPO_CHECK": str(Path(sys.executable).parent / "verl-dppo"),
    }
    try:
        subprocess.run(["bash", str(script)], cwd=script.parent, env=env, capture_output=True, timeout=timeout_s)
        timed_out = False
    except subprocess.TimeoutExpired:
        timed_out = True
    codes = (results / "rc").read_text().split() if (results / "rc").is_file() else []
    said = (results / "lines").read_text().splitlines() if (results / "lines").is_file() else []
    first = {
        kind: next(
            (line[len(f"verl-dppo: {kind}: ") :] for line in said if line.startswith(f"verl-dppo: {kind}: ")), ""
        )
        for kind in ("problem", "not here")
    }
    return {"codes": [int(code) for code in codes], **first, "lines": said, "timed_out": timed_out}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("examples", type=Path, help="verl's examples/ folder (a checkout of verl)")
    parser.add_argument("--out", type=Path, help="also write the table here (Markdown)")
    parser.add_argument("--json", type=Path, help="also write every script's result here")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--timeout", type=int, default=300, help="seconds per script")
    args = parser.parse_args()
    scripts = sorted(args.examples.rglob("*.sh"))
    if not scripts:
        raise SystemExit(f"no *.sh under {args.examples}")
    with tempfile.TemporaryDirectory() as folder:
        work = Path(folder)
        shims = shim_folder(work)
        lines_file = work / "switch_lines"
        lines_file.write_text("\n".join(FROM_GRPO) + "\n")
        with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
            found = dict(
                zip(scripts, pool.map(lambda s: check_script(s, shims, lines_file, work, args.timeout), scripts))
            )
    rows = ["| script | check's exit codes | first problem, else first not-here |", "|---|---|---|"]
    counts = collections.Counter()
    for script, result in found.items():
        codes = result["codes"]
        verdict = "no main_ppo call" if not codes else f"exit {max(codes)}"
        counts[verdict + (" (timed out)" if result["timed_out"] else "")] += 1
        shown = " ".join(map(str, codes)) or "-"
        said = result["problem"] or (f"not here: {result['not here']}" if result["not here"] else "")
        rows.append(f"| {script.relative_to(args.examples)} | {shown} | {said[:200]} |")
    summary = ", ".join(f"{verdict}: {n}" for verdict, n in sorted(counts.items()))
    table = "\n".join(rows) + f"\n\n{len(scripts)} scripts: {summary}\n"
    print(table)
    if args.out:
        args.out.write_text(table)
    if args.json:
        args.json.write_text(json.dumps({str(k): v for k, v in found.items()}, indent=1))
    print("command switched by:", shlex.join(FROM_GRPO), file=sys.stderr)


if __name__ == "__main__":
    main()
