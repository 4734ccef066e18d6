"""`ingot` CLI: one typer app, one small module per command.

User errors (`IngotError`) become one line on stderr and exit code 2; an interrupt exits 130;
a bug becomes one line, a crash report file and exit code 1 (cli/crash_report.py).
"""

from __future__ import annotations

import functools
import importlib
import sys
import warnings
from collections.abc import Callable
from typing import Any

import typer
from typer.core import TyperGroup

from ingot.cli.crash_report import (
    INTERNAL_ERROR_EXIT_CODE,
    first_line,
    internal_error_line,
    show_traceback,
    write_crash_report,
)
from ingot.runtime.errors import IngotError, IngotWarning
from ingot.runtime.version import INGOT_VERSION


def _click_errors(name: str) -> tuple[type[BaseException], ...]:
    """`name` from click and from the click that newer typer releases vendor as typer._click."""
    found = []
    for mod in ("typer._click.exceptions", "click.exceptions"):
        try:
            found.append(getattr(importlib.import_module(mod), name))
        except (ImportError, AttributeError):
            pass
    return tuple(found)


_USAGE_ERRORS = _click_errors("UsageError")
_ABORTS = _click_errors("Abort")
# a command's own exit code or abort: RuntimeErrors to Python, not bugs
_NOT_BUGS = (typer.Exit, typer.Abort, *_click_errors("Exit"), *_ABORTS)
INTERRUPTED = "interrupted; no partial output was left behind"


class OneLineErrors(TyperGroup):
    """Usage errors (unknown flag, missing option, bad value) as one line, exit code 2."""

    def main(self, *args: Any, **kwargs: Any) -> Any:
        kwargs["standalone_mode"] = False
        try:
            code = super().main(*args, **kwargs)
        except _USAGE_ERRORS as e:
            if type(e).__name__ == "NoArgsIsHelpError" and e.ctx is not None:
                typer.echo(e.ctx.get_help())
                sys.exit(0)
            cmd = e.ctx.command_path if e.ctx else "ingot"
            typer.echo(f"error: {e.format_message()} (see '{cmd} --help')", err=True)
            sys.exit(2)
        except _ABORTS:
            typer.echo(INTERRUPTED, err=True)
            sys.exit(130)
        except Exception as e:  # a bug outside any command's body: an option callback, say
            if show_traceback():
                raise
            typer.echo(f"error: {_bug_line(e)}", err=True)
            sys.exit(INTERNAL_ERROR_EXIT_CODE)
        sys.exit(code if isinstance(code, int) else 0)


app = typer.Typer(
    name="ingot",
    cls=OneLineErrors,
    help="Compile Hugging Face checkpoints into engines for one GPU (or the CPU) and run them.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def fail(message: str, code: int = 2) -> None:
    """Print one line to stderr and exit."""
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)


def _one_line_warnings() -> None:
    """IngotWarning as one `warning:` line on stderr; other warnings as Python shows them."""
    shown = warnings.showwarning
    if getattr(shown, "ingot", False):
        return

    def show(message, category, filename, lineno, file=None, line=None):
        if issubclass(category, IngotWarning):
            typer.echo(f"warning: {message}", err=True)
        else:
            shown(message, category, filename, lineno, file, line)

    show.ingot = True
    warnings.showwarning = show
    warnings.simplefilter("always", IngotWarning)  # each time, not once per code location


def _out_of_memory(e: Exception) -> str | None:
    """'GPU' or 'host' when `e` is an allocation failure, else None."""
    # NOTE: matched by name so the CLI need not import torch to start.
    name = type(e).__name__
    if name == "OutOfMemoryError":
        return "GPU"
    # torch's CPU allocator raises a plain RuntimeError
    if name == "MemoryError" or (name == "RuntimeError" and "can't allocate memory" in str(e)):
        return "host"
    return None


def _bug_line(e: Exception) -> str:
    """The one line a bug gets, after its traceback went to a crash report file."""
    return internal_error_line(e, write_crash_report(e))


def user_errors(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Turn IngotError / bad values into one clear line and exit code 2 (never a traceback);
    IngotWarning into one `warning:` line; a bug into one line, a crash report and exit code 1."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        _one_line_warnings()
        try:
            return fn(*args, **kwargs)
        except IngotError as e:
            fail(e.one_line(), e.exit_code)
        except KeyboardInterrupt:
            typer.echo(INTERRUPTED, err=True)
            raise typer.Exit(130) from None
        except _NOT_BUGS:
            raise
        except Exception as e:
            where = _out_of_memory(e)
            if where is not None:
                fail(
                    f"out of {where} memory ({first_line(e, 160)}) (lower "
                    "--kv-cache-free-gpu-memory-fraction or --num-kv-blocks, or rebuild with "
                    "a smaller --max-batch-size / --max-num-tokens / --max-seq-len)"
                )
            if show_traceback():
                raise
            fail(_bug_line(e), INTERNAL_ERROR_EXIT_CODE)

    return wrapper


def _version_callback(value: bool) -> None:
    if value:
        typer.echo(f"ingot {INGOT_VERSION}")
        raise typer.Exit()


@app.callback()
def main(
    version: bool = typer.Option(
        False,
        "--version",
        callback=_version_callback,
        is_eager=True,
        help="Print the ingot version and exit.",
    ),
) -> None:
    """ingot: convert-checkpoint -> build-engine -> run-engine."""


def _register() -> None:
    # NOTE: imported here so each command module can import `user_errors` from this module.
    from ingot.cli import commands  # noqa: F401


_register()
