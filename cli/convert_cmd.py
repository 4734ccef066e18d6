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
    quant: str = typer.Option(
        "none", "--quant", help="none|fp8 (W8A8, per-tensor)|int4_awq (W4A16, group 128)."
    ),
    kv_cache_dtype: str = typer.Option(
        "auto", "--kv-cache-dtype", help="auto (the model dtype)|fp8 (calibrated K/V scales)."
    ),
    calib_dataset: Path = typer.Option(
        None, "--calib-dataset", help="Calibration text file. [the text shipped with ingot]"
    ),
    calib_size: int = typer.Option(32, "--calib-size", help="Most calibration sequences."),
    calib_max_seq_len: int = typer.Option(
        512, "--calib-max-seq-len", help="Tokens per calibration sequence."
    ),
    device: str = typer.Option(
        "auto", "--device", help="Where to calibrate: auto (cuda if present)|cpu|cuda."
    ),
    quant_lm_head: bool = typer.Option(
        False,
        "--quant-lm-head",
        help="With --quant fp8 or int4_awq: quantize the lm_head too, to FP8 (it stays in the "
        "model dtype by default). Halves its bytes per decode step (1.05 GB in BF16 at "
        "Llama-3.1-8B); needs an FP8 GPU (sm_89+); the accuracy report measures what it costs.",
    ),
    tp_size: int = typer.Option(
        1,
        "--tp-size",
        help="Tensor-parallel ranks: shard into rank{N}.safetensors (divides the head counts).",
    ),
) -> None:
    """Convert a Hugging Face checkpoint into an ingot checkpoint (names mapped, QKV fused),
    optionally quantized with nvidia-modelopt (FP8, INT4 AWQ, FP8 KV cache)."""
    if dtype not in DTYPE_CHOICES:
        raise ConfigError(
            f"unknown --dtype {dtype!r}", hint=f"choose one of {', '.join(DTYPE_CHOICES)}"
        )
    # NOTE: imported here so `ingot --help` stays fast (torch/safetensors load lazily).
    from ingot.compiler.convert import convert_checkpoint
    from ingot.compiler.quantize import QuantOptions

    options = QuantOptions(
        mode=quant,
        kv_cache_dtype=kv_cache_dtype,
        calib_dataset=calib_dataset,
        calib_size=calib_size,
        calib_max_seq_len=calib_max_seq_len,
        device=device,
        lm_head=quant_lm_head,
    )

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

        out = convert_checkpoint(
            model_dir,
            output_dir,
            dtype=dtype,
            force=force,
            progress=report,
            quant=options,
            tp_size=tp_size,
        )
    typer.echo(f"wrote checkpoint to {out}")
    summary = quant_summary(out)
    if summary:
        typer.echo(summary)


def quant_summary(ckpt_dir: Path) -> str | None:
    """A line on a quantized checkpoint's accuracy report, then one on where the quantization's
    time went (None when there is no report)."""
    import json

    rep = json.loads((Path(ckpt_dir) / "config.json").read_text()).get("quant_report")
    if not rep:
        return None
    line = (
        f"accuracy vs unquantized on {rep['held_out']['positions']} held-out tokens: "
        f"top-1 agreement {rep['top1_agreement']:.3f}, mean KL {rep['mean_kl']:.4g} nats"
    )
    phases = rep.get("seconds")  # checkpoints before it do not record them
    if phases:
        line += (
            f"\nquantization took {sum(phases.values()):.1f} s ("
            + ", ".join(f"{k.replace('_', ' ')} {v:.1f}" for k, v in phases.items())
            + ")"
        )
    return line
