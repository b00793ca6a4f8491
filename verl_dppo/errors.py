"""The command line's one error type: what a user typed or pointed at is wrong, and the message says what to change.

`run_handler` (what `verl_dppo.cli.main` and `verl-dppo check --rehearse` call) prints it as one line on stderr and
exits 2 (the style guide: never a traceback for a user's mistake). The commands' own error types (`RecipeError`,
`DataError`, `PlotError`) derive from it. A leaf module: every layer above the plugin may import it.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

EXIT_USAGE = 2


class UsageError(Exception):
    """A bad input: reported as `verl-dppo: error: <message>`, exit 2."""


def writable_folder(path: str, flag: str) -> str:
    """Create the output folder `path` (named on the command line by `flag`) or raise UsageError saying why not.

    Called before any slow work, so that a typo in --out does not cost a warm-up or a download first."""
    folder = os.path.expanduser(path)
    if os.path.exists(folder) and not os.path.isdir(folder):
        raise UsageError(f"{flag} {path}: is a file, not a folder; name a folder (it is created if missing)")
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as error:
        raise UsageError(f"{flag} {path}: cannot create the folder ({error.strerror or error})") from None
    if not os.access(folder, os.W_OK | os.X_OK):
        raise UsageError(f"{flag} {path}: the folder is not writable; name another one")
    return folder


def run_handler(args) -> int:
    """Call a parsed command's handler (`args.handler(args)`). A user's mistake (UsageError, a file that cannot be
    read or written, a Ray cluster that does not answer) is one line on stderr and exit 2."""
    try:
        return int(args.handler(args) or 0)
    except UsageError as error:
        return report(str(error))
    except BrokenPipeError:
        # `verl-dppo recipes -v | head`: the reader left; stop quietly. Point stdout at devnull so that the
        # interpreter's final flush does not raise the same error again.
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except (OSError, ValueError):
            pass
        return 0
    except KeyboardInterrupt:
        print("verl-dppo: interrupted", file=sys.stderr)
        return 130
    except ConnectionError as error:  # Ray's "could not connect" among them
        return report(
            f"cannot connect: {_first_line(error)} (check RAY_ADDRESS / --ray-address, or start the "
            "cluster with `ray start --head`)"
        )
    except OSError as error:
        where = f"{error.filename}: " if error.filename else ""
        return report(f"{where}{error.strerror or _first_line(error)}")
    except ImportError as error:
        if not _raised_by_verls_import(error):
            raise
        # verl's own __init__ refusing this machine's environment (VERL_USE_MODELSCOPE=True without modelscope)
        return report(f"verl does not import here: {_first_line(error)}")


def _raised_by_verls_import(error: BaseException) -> bool:
    """Whether `error` was raised by verl's package `__init__` itself (not by an import inside it, nor by ours)."""
    frame = error.__traceback__
    while frame is not None and frame.tb_next is not None:
        frame = frame.tb_next
    return frame is not None and Path(frame.tb_frame.f_code.co_filename).parts[-2:] == ("verl", "__init__.py")


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def report(message: str) -> int:
    """`verl-dppo: error: <first line>` on stderr, the other lines indented under it; exit 2."""
    lines = message.strip().splitlines() or [""]
    print(f"verl-dppo: error: {lines[0]}", file=sys.stderr)
    for line in lines[1:]:  # a list of problems (run) keeps its items, indented under the one error line
        print(line, file=sys.stderr)
    return EXIT_USAGE
