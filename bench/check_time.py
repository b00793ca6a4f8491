"""How long `verl-dppo check` takes on a correct command, against the import of verl's main_ppo it cannot avoid.

    .venv/bin/python bench/check_time.py [--repeats 7]

The command: verl's GRPO example (examples/grpo_trainer/run_qwen2-7b.sh, its data files made in a temporary folder)
switched by the README's "From GRPO" lines, as `tests/test_check.py` builds it; `verl-dppo check` exits 0 on it.
Each repeat runs, one after the other in fresh processes, `verl-dppo check COMMAND` and `python -c "import
verl.trainer.main_ppo"` (verl, tensordict, torch and transformers: what reading verl's config classes costs any
checker); prints each side's median and minimum wall time and the median of check less the import. Issue 73's goal:
check's median at most 10 s on these machines, idle.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from test_check import verl_grpo_example  # noqa: E402
from test_cli_errors import FROM_GRPO  # noqa: E402


def timed(command: list[str]) -> float:
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{command[:3]}... exited {done.returncode}:\n{done.stderr[-2000:]}")
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    bin_dir = Path(sys.executable).parent
    with tempfile.TemporaryDirectory() as folder:
        command = [*verl_grpo_example(Path(folder)), *FROM_GRPO]
        check, imports = [], []
        for _ in range(args.repeats):
            check.append(timed([str(bin_dir / "verl-dppo"), "check", *command]))
            imports.append(timed([sys.executable, "-c", "import verl.trainer.main_ppo"]))
    for name, times in (("verl-dppo check", check), ("import verl.trainer.main_ppo", imports)):
        print(
            f"{name}: median {statistics.median(times):.2f} s, min {min(times):.2f} s "
            f"({', '.join(f'{t:.2f}' for t in times)})"
        )
    print(f"check less the import: median {statistics.median(c - i for c, i in zip(check, imports)):.2f} s")


if __name__ == "__main__":
    main()
