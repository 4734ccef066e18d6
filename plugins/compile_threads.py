"""Triton compiles in threads: its heavy parts (LLVM, ptxas) run outside the GIL, so a build's
kernels compile side by side instead of one after another."""

from __future__ import annotations

import ast
import contextlib
import os
import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")
R = TypeVar("R")


def compile_threads() -> int:
    """Threads to compile with: INGOT_COMPILE_THREADS, else one per CPU core (1: in turn)."""
    env = os.environ.get("INGOT_COMPILE_THREADS", "").strip()
    if env:
        if not env.isdigit() or int(env) < 1:
            from ingot.runtime.errors import ConfigError

            raise ConfigError(
                f"INGOT_COMPILE_THREADS={env!r} is not a positive integer",
                "set it to the number of compile threads, or unset it for one per CPU core",
            )
        return int(env)
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def map_in_threads(fn: Callable[[T], R], items: Iterable[T]) -> list[R]:
    """[fn(x) for x in items], in order, on up to compile_threads() threads. The first
    exception raised by fn is raised here (after the others finish)."""
    items = list(items)
    workers = min(len(items), compile_threads())
    if workers <= 1:
        return [fn(x) for x in items]
    with (
        serial_ast_parse(),
        ThreadPoolExecutor(workers, thread_name_prefix="ingot-compile") as pool,
    ):
        return list(pool.map(fn, items))


_PARSE_LOCK = threading.RLock()  # NOTE: re-entrant: a finalizer run mid-parse may parse too
_PATCH_LOCK = threading.Lock()
_patched: list[Callable[..., Any]] = []  # ast.parse as it was, while some block is open
_open_blocks = 0


def _locked_parse(*args: Any, **kwargs: Any) -> Any:
    with _PARSE_LOCK:
        return _patched[0](*args, **kwargs)


@contextlib.contextmanager
def serial_ast_parse() -> Iterator[None]:
    """ast.parse one thread at a time inside the block (Triton's front end parses each kernel).

    CPython keeps ast.parse's recursion depth in interpreter-wide state; when a garbage
    collection mid-parse lets another thread parse, the first raises "SystemError: AST constructor
    recursion depth mismatch" (seen in a CI sm_90 cross-build). Parsing takes milliseconds of a
    compile's seconds, so serialising it costs nothing that matters. Blocks may nest or overlap
    (builds in several threads): the first to open swaps ast.parse, the last to close restores it."""
    global _open_blocks
    with _PATCH_LOCK:
        if _open_blocks == 0:
            _patched[:] = [ast.parse]
            ast.parse = _locked_parse
        _open_blocks += 1
    try:
        yield
    finally:
        with _PATCH_LOCK:
            _open_blocks -= 1
            if _open_blocks == 0:
                ast.parse = _patched.pop()
