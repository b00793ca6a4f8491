"""`verl-dppo check` on every one of verl's example scripts, switched by the README's "From GRPO" lines.

    git clone --branch v0.9.1 --depth 1 https://github.com/volcengine/verl /tmp/verl-0.9.1
    .venv/bin/python bench/check_verl_scripts.py /tmp/verl-0.9.1/examples [--out table.md] [--jobs 2]

Each `*.sh` under the folder runs under bash as it is, from the checkout's root as verl's docs run them, with
`python`, `python3`, `uv`, `torchrun` and `ray` on PATH replaced by a shim: a call whose words name `main_ppo` (or
another `verl.` entry point, which check answers in one line) becomes `verl-dppo check <the call as the script made
it> <the README's lines>`, its exit code and lines recorded (its every line in `--json`); every other call (a data
preprocessor, a checkpoint converter, `ray start`) does nothing and succeeds. So the script's own variables, loops and
`$@` fill the command as they would on the cluster, and nothing is launched or downloaded. Prints one row per script
(the exit codes of its checks, its first `problem` line, else its first `not here`) and the count of scripts by exit
code; a script with no such call is counted apart. Beside each, a second opinion from Hydra alone (`hydra_alone`:
Hydra's own `compose` of the same call) and the two set against each other (`agreement`): exit 2 where Hydra refuses,
exit 0 or 3 where it composes, is agreement; a problem where Hydra composes is check going further (verl's config
classes, its validate_config or the plugin's rules: the reader judges that row against the script); exit 3 (the data
or model is not on this machine) is what a right command gets here.

verl's examples are not part of its wheel or its PyPI sdist: the folder comes from a checkout of verl.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import json
import os
import re
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
      printf '%s\0' "$@" "${lines[@]}" > "$DPPO_RESULTS/argv.$(date +%s%N)"
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


BASH_ENV = """# read by bash before each script (BASH_ENV): what a cluster's shell allows and this one may not
ulimit() { builtin ulimit "$@" 2>/dev/null || true; }
"""


def check_script(script: Path, root: Path, shims: Path, lines_file: Path, work: Path, timeout_s: int) -> dict:
    """Run one script as verl's docs do (`bash examples/.../run_x.sh` from the checkout's root, the parent of the
    examples folder: `run_all.sh` calls the others by that path, `data/...` is read from there)."""
    results = Path(tempfile.mkdtemp(dir=work))
    env = {
        "LD_LIBRARY_PATH": "",  # set on a cluster's GPU nodes; a script under `set -u` reads it
        **os.environ,
        "BASH_ENV": str(work / "bash_env"),
        "PATH": f"{shims}:{os.environ['PATH']}",
        "DPPO_SWITCH_LINES": str(lines_file),
        "DPPO_RESULTS": str(results),
        "DPPO_CHECK": str(Path(sys.executable).parent / "verl-dppo"),
    }
    stopped = ""
    try:
        done = subprocess.run(
            ["bash", str(script)], cwd=root, env=env, capture_output=True, timeout=timeout_s, text=True
        )
        timed_out = False
        errors = [line for line in done.stderr.splitlines() if line.strip() and not line.startswith("+")]
        stopped = errors[-1] if done.returncode and errors else ""
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
    calls = [path.read_bytes().decode().split("\0")[:-1] for path in sorted(results.glob("argv.*"))]
    return {
        "codes": [int(code) for code in codes],
        **first,
        "lines": said,
        "timed_out": timed_out,
        "calls": calls,
        "stopped": stopped,
    }


def hydra_alone(call: list[str]) -> str:
    """What Hydra's own `compose` says of one main_ppo call (its words as the script made them, the README's lines
    after them): "composes", or its error's first line. A second opinion beside check's, from Hydra alone: a command
    Hydra refuses must get exit 2 from check, naming the same key. (The launch line is split into launcher words and
    overrides by the plugin's `parse_launch`; the config folder is the one Hydra reads for main_ppo; the caller runs it
    from the folder the script ran from.)"""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from verl_dppo.launch.launch_line import config_folder, parse_launch

    try:
        launch = parse_launch(call)
        folder = config_folder(launch)
        GlobalHydra.instance().clear()
        with initialize_config_dir(str(folder), version_base=None):
            compose(launch.config_name, overrides=launch.overrides)
        return "composes"
    except Exception as error:  # noqa: BLE001  (Hydra's, OmegaConf's or the parser's: each is an answer here)
        return f"{type(error).__name__}: {(str(error).strip().splitlines() or [''])[0][:160]}"


def agreement(result: dict) -> str:
    """check's verdict against Hydra's alone: "agree" where check says exit 2 to what Hydra refuses (naming the key
    Hydra's message names) and exit 0/3 to what it composes; "check goes further" where Hydra composes and check
    finds a problem (verl's config classes, validate_config or the plugin's rules: the problem line says which);
    "miss" where Hydra refuses and check does not; "crash" for exit 1. A primary config folder that is not on this
    machine (`--config-path`: its configs were not fetched, or a folder of the author's machine) is exit 3 to check
    and not found to Hydra: agreement, neither can read the config here."""
    codes, hydra = result["codes"], result.get("hydra", [])
    if not codes:
        return "no main_ppo call"
    if 1 in codes:
        return "crash"
    problems = [line for line in result["lines"] if line.startswith("verl-dppo: problem: ")]
    verdicts = []
    for code, said in zip(codes, hydra):
        refused = said != "composes" and not (code == 3 and "Primary config directory not found" in said)
        named = re.findall(r"'([^']+)'", said)[:1]  # Hydra's "Could not override 'KEY'", "already at 'KEY'"
        verdicts.append(
            "miss"
            if refused and code != 2
            else "check goes further"
            if not refused and code == 2
            else "agree on the exit, not the key"
            if named and not any(named[0] in line for line in problems)
            else "agree"
        )
    order = ("miss", "agree on the exit, not the key", "check goes further", "agree")
    return next((verdict for verdict in order if verdict in verdicts), "agree")


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
        (work / "bash_env").write_text(BASH_ENV)
        with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
            found = dict(
                zip(
                    scripts,
                    pool.map(
                        lambda s: check_script(
                            s, args.examples.resolve().parent, shims, lines_file, work, args.timeout
                        ),
                        scripts,
                    ),
                )
            )
    cwd = os.getcwd()
    os.chdir(args.examples.resolve().parent)  # where the scripts ran: a config's relative search path is read there
    try:
        for result in found.values():  # in this thread: Hydra's global state is one per process
            result["hydra"] = [hydra_alone(call) for call in result["calls"]]
            result["agreement"] = agreement(result)
    finally:
        os.chdir(cwd)
    rows = [
        "| script | check's exit codes | first problem, else first not-here | Hydra alone | against Hydra |",
        "|---|---|---|---|---|",
    ]
    counts, agreements = collections.Counter(), collections.Counter()
    for script, result in found.items():
        codes = result["codes"]
        verdict = "no main_ppo call" if not codes else f"exit {max(codes)}"
        counts[verdict + (" (timed out)" if result["timed_out"] else "")] += 1
        agreements[result["agreement"]] += 1
        shown = " ".join(map(str, codes)) or "-"
        said = result["problem"] or (f"not here: {result['not here']}" if result["not here"] else "")
        said = said or (f"the script stopped first: {result['stopped']}" if result["stopped"] else "")
        hydra = "; ".join(result["hydra"]) or "-"
        rows.append(
            f"| {script.relative_to(args.examples)} | {shown} | {said[:200]} | {hydra[:120]} | {result['agreement']} |"
        )
    summary = ", ".join(f"{verdict}: {n}" for verdict, n in sorted(counts.items()))
    against = ", ".join(f"{verdict}: {n}" for verdict, n in sorted(agreements.items()))
    table = "\n".join(rows) + f"\n\n{len(scripts)} scripts: {summary}\nagainst Hydra alone: {against}\n"
    print(table)
    if args.out:
        args.out.write_text(table)
    if args.json:
        args.json.write_text(json.dumps({str(k): v for k, v in found.items()}, indent=1))
    print("command switched by:", shlex.join(FROM_GRPO), file=sys.stderr)


if __name__ == "__main__":
    main()
