"""The command line's one error type: what a user typed or pointed at is wrong, and the message says what to change.

`verl_dppo.cli.main` prints it as one line on stderr and exits 2 (the style guide: never a traceback for a user's
mistake). The commands' own error types (`RecipeError`, `DataError`, `PlotError`) derive from it.
"""

from __future__ import annotations

import os

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
