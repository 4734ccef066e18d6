"""A bug inside ingot (not bad input) as one line plus a report file, instead of a traceback.

Bad input is an `IngotError` (exit code 2). Anything else that escapes a command is ingot's
fault: the user gets one line naming the error and a file holding the full traceback to attach
to a bug report, and exit code 1 so scripts can tell the two apart. `INGOT_TRACEBACK=1` lets
the exception through unchanged, for debugging.
"""

from __future__ import annotations

import os
import platform
import sys
import tempfile
import time
import traceback
from pathlib import Path

from ingot.runtime.version import INGOT_VERSION

INTERNAL_ERROR_EXIT_CODE = 1
_SHOW_TRACEBACK_ENV = "INGOT_TRACEBACK"


def show_traceback() -> bool:
    return os.environ.get(_SHOW_TRACEBACK_ENV, "") not in ("", "0")


def first_line(exc: BaseException, limit: int) -> str:
    """The exception's message cut to one line of at most `limit` characters."""
    return str(exc).splitlines()[0][:limit] if str(exc) else "no detail"


def write_crash_report(exc: BaseException) -> Path | None:
    """Write the traceback and what ran into a new file in the temp dir; None if that fails."""
    text = "".join(
        [
            f"ingot {INGOT_VERSION}\n",
            f"command: {' '.join(sys.argv)}\n",
            f"python {platform.python_version()} on {platform.platform()}\n",
            f"time: {time.strftime('%Y-%m-%d %H:%M:%S %Z')}\n\n",
            *traceback.format_exception(exc),
        ]
    )
    try:
        fd, name = tempfile.mkstemp(prefix="ingot-crash-", suffix=".txt")
        with os.fdopen(fd, "w") as f:
            f.write(text)
    except OSError:  # NOTE: a full or read-only temp dir must not hide the original error
        return None
    return Path(name)


def internal_error_line(exc: BaseException, report: Path | None) -> str:
    """One line: what failed, that it is a bug, and where the traceback went."""
    detail = first_line(exc, 200)
    where = (
        f"the traceback is in {report}; please attach it to a bug report"
        if report is not None
        else f"set {_SHOW_TRACEBACK_ENV}=1 and rerun to see the traceback"
    )
    return (
        f"internal error, a bug in ingot rather than in your input "
        f"({type(exc).__name__}: {detail}); no partial output was left behind; {where}"
    )
