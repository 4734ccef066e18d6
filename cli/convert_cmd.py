"""`ingot convert-checkpoint`: HF model dir -> ingot checkpoint dir."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from ingot.runtime.errors import ConfigError

DTYPE_CHOICES = ("auto", "bfloat16", "float16", "float32")


def convert_checkpoint_cmd(
    model_dir: Path = typer.Option(
        ..., "--model-dir", help="Local Hugging Face model dir (config.json + *.safetensors)."
    ),
    output_dir: Path = typer.Option(..., "--output-dir", help="Checkpoint dir to write."),
    dtype: str = typer.Option("auto", "--dtype", help="auto|bfloat16|float16|float32"),
    force: bool = typer.Option(False, "--force", help="Replace an existing checkpoint dir."),
) -> None:
    """Convert a Hugging Face checkpoint into an ingot checkpoint (names mapped, QKV fused)."""
    if dtype not in DTYPE_CHOICES:
        raise ConfigError(
            f"unknown --dtype {dtype!r}", hint=f"choose one of {', '.join(DTYPE_CHOICES)}"
        )
    # NOTE: imported here so `ingot --help` stays fast (torch/safetensors load lazily).
    from ingot.compiler.convert import convert_checkpoint

    console = Console(stderr=True)
    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
    )
    # NOTE: no live bar when stderr is not a terminal, so logs and errors stay one clean line.
    with Progress(
        *columns, console=console, transient=True, disable=not console.is_terminal
    ) as bar:
        task = bar.add_task("reading", total=None)

        def report(desc: str, done: int, total: int) -> None:
            bar.update(task, description=desc, completed=done, total=total)

        out = convert_checkpoint(model_dir, output_dir, dtype=dtype, force=force, progress=report)
    typer.echo(f"wrote checkpoint to {out}")
