"""A rich progress bar behind the `progress(step, done, total)` callback the compiler takes."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn


@contextmanager
def progress_bar() -> Iterator[Callable[[str, int, int], None]]:
    """The bar starts with the first update: a command that fails before any work (bad input)
    prints its one error line and nothing else."""
    console = Console(stderr=True)
    bar: Progress | None = None
    tasks: dict[str, int] = {}

    def update(step: str, done: int, total: int) -> None:
        nonlocal bar
        if bar is None:
            bar = Progress(
                TextColumn("{task.description:<20}"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                console=console,
                transient=not console.is_terminal,
            )
            bar.start()
        if step not in tasks:
            tasks[step] = bar.add_task(step, total=total)
        bar.update(tasks[step], completed=done, total=total)

    try:
        yield update
    finally:
        if bar is not None:
            bar.stop()
