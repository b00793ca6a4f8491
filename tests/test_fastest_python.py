"""The interpreter `make` builds .venv with when PYTHON is not given (`tools/fastest-python`): of the Python 3.11
interpreters on PATH that can make a virtual environment, the one that runs its pure-Python loop in the least CPU
time; `python3` when PATH holds none. The candidates here are scripts that answer the tool's two questions (which
interpreter are you, how long did the loop take) as a fixed interpreter would, so the choice is exact, beside this
test's own interpreter, which runs the loop for real.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TOOL = REPO / "tools" / "fastest-python"


def fake_python(directory: Path, name: str, *, version_ok: bool, loop_seconds: float | None) -> Path:
    """A `name` in `directory` that, asked the tool's probe, says it is itself (or exits 1, as a Python of another
    version does) and, asked to run the loop, says it took `loop_seconds` (or fails, when None)."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / name
    path.write_text(
        "#!/bin/sh\n"
        'case "$2" in\n'
        f"  *ensurepip*) {'echo ' + str(path) if version_ok else 'exit 1'} ;;\n"
        f"  *) {'exit 1' if loop_seconds is None else f'echo {loop_seconds}'} ;;\n"
        "esac\n"
    )
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return path


def choose(path_dirs: list[Path]) -> subprocess.CompletedProcess:
    env = dict(os.environ, PATH=os.pathsep.join(map(str, path_dirs)))
    return subprocess.run([sys.executable, str(TOOL)], env=env, capture_output=True, text=True, check=True, timeout=120)


def test_the_fastest_python_311_on_path_is_chosen_and_each_candidate_once(tmp_path):
    real = Path(sys.executable).parent  # this test's interpreter: a Python 3.11, its loop timed for real
    slow = fake_python(tmp_path / "slow", "python3.11", version_ok=True, loop_seconds=99.0)
    fast = fake_python(tmp_path / "fast", "python3", version_ok=True, loop_seconds=0.001)
    other = fake_python(tmp_path / "other", "python3.11", version_ok=False, loop_seconds=0.0)  # e.g. a 3.12

    result = choose([tmp_path / "other", tmp_path / "slow", real, tmp_path / "fast"])
    assert result.stdout.strip() == str(fast)
    timed = [line.split()[1] for line in result.stderr.splitlines() if line.startswith("fastest-python: ")]
    assert timed[0] == str(slow) and timed[-1] == str(fast) and str(other) not in timed
    assert len(timed) == len(set(timed)) == 3  # the real interpreter once, though PATH offers python3 and python3.11

    # Without the fast one, the real interpreter beats the slow one on its own timed loop.
    result = choose([tmp_path / "other", tmp_path / "slow", real])
    assert os.path.realpath(result.stdout.strip()) == os.path.realpath(sys.executable)


def test_with_no_python_311_on_path_make_falls_back_to_python3(tmp_path):
    fake_python(tmp_path / "other", "python3.11", version_ok=False, loop_seconds=0.0)
    assert choose([tmp_path / "other"]).stdout.strip() == "python3"
    assert choose([tmp_path / "nothing-here"]).stdout.strip() == "python3"


def test_a_candidate_that_fails_the_loop_is_not_chosen_and_stops_nothing(tmp_path):
    fake_python(tmp_path / "broken", "python3.11", version_ok=True, loop_seconds=None)
    result = choose([tmp_path / "broken", Path(sys.executable).parent])
    assert os.path.realpath(result.stdout.strip()) == os.path.realpath(sys.executable)
