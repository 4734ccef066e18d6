"""Typed user errors. The CLI prints each as one line with its hint and exits with code 2."""

from __future__ import annotations


class IngotError(Exception):
    """A user-facing error: what is wrong (message) and how to fix it (hint)."""

    exit_code = 2

    def __init__(self, message: str, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def one_line(self) -> str:
        text = f"{self.message} ({self.hint})" if self.hint else self.message
        # NOTE: a message that quotes another library's error may span lines; the CLI's
        # contract is one line
        return " ".join(part.strip() for part in text.splitlines() if part.strip())


class IngotWarning(UserWarning):
    """Something the user should know that does not stop the work (e.g. an engine tuned on
    another GPU model); the CLI prints it as one line starting with `warning:`."""


class CheckpointError(IngotError):
    """A Hugging Face model dir or an ingot checkpoint dir is missing, malformed or unsupported."""


class EngineError(IngotError):
    """An engine dir is missing, corrupt, of another format version or built for another target."""


class ConfigError(IngotError):
    """A flag, preset or config value is invalid."""


class OutputExistsError(IngotError):
    """The output dir already holds an artifact and --force was not given."""


class RequestError(IngotError):
    """One request is invalid (e.g. prompt too long); it fails alone, the others go on."""
