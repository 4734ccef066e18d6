"""Triton compiles in threads: its heavy parts (LLVM, ptxas) run outside the GIL, so a build's
kernels compile side by side instead of one after another."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

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
    with ThreadPoolExecutor(workers, thread_name_prefix="ingot-compile") as pool:
        return list(pool.map(fn, items))
