"""Text files named on the command line (prompts, calibration text, bench datasets), read as
UTF-8 with one clear error for each way they go wrong."""

from __future__ import annotations

from pathlib import Path

from .errors import ConfigError


def read_user_text(path: Path, what: str, hint: str) -> str:
    """The file's text. what names it in the message ("--input-file x.txt"); hint says what to
    pass instead. A missing path, a directory, unreadable or non-UTF-8 bytes: ConfigError."""
    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"{what} is a directory, not a file", hint)
    if not path.exists():
        raise ConfigError(f"{what} does not exist", hint)
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(
            f"{what} is not UTF-8 text (byte {e.object[e.start]:#04x} at offset {e.start})", hint
        ) from None
    except OSError as e:
        raise ConfigError(f"cannot read {what}: {e.strerror or e}", hint) from None
