"""`ingot build-engine`."""

from __future__ import annotations

from pathlib import Path

import typer

from ingot.cli.progress import progress_bar


def build_engine_cmd(
    checkpoint_dir: Path = typer.Option(
        ..., "--checkpoint-dir", help="Checkpoint dir written by convert-checkpoint."
    ),
    output_dir: Path = typer.Option(
        ..., "--output-dir", help="Engine dir to write (config.json + rank0.engine + tokenizer/)."
    ),
    max_batch_size: int = typer.Option(
        None, "--max-batch-size", help="Most sequences in one step. [preset or 64]"
    ),
    max_seq_len: int = typer.Option(
        None, "--max-seq-len", help="Most tokens (prompt + output) per sequence. [preset or 2048]"
    ),
    max_num_tokens: int = typer.Option(
        None,
        "--max-num-tokens",
        help="Most tokens computed in one step (chunked prefill). [preset or 8192]",
    ),
    tokens_per_block: int = typer.Option(
        None,
        "--tokens-per-block",
        help="KV-cache block size in tokens, a power of two. [preset or 16]",
    ),
    target: str = typer.Option(
        "auto",
        "--target",
        help="cpu, auto (this machine's GPU if any, else cpu), or a GPU arch like sm_90.",
    ),
    config: str = typer.Option(
        None,
        "--config",
        help="Build preset: a YAML path or a name from ingot's configs/ (flags override it).",
    ),
    tactics: str = typer.Option(
        "auto",
        "--tactics",
        help="auto: time each kernel's candidates on the target GPU and keep the fastest "
        "(default tactics when this machine lacks that GPU); default: skip timing.",
    ),
    pdl: bool = typer.Option(
        None,
        "--pdl/--no-pdl",
        help="Programmatic dependent launch between the Triton kernels of small decode batches "
        "(up to 8 tokens; sm_90+): each may start while the one before it runs, and the decode "
        "GEMVs load their weights meanwhile. On an H200 (Llama-3.1-8B shapes, BF16) batch-1 "
        "decode ran +3.4% and +4.3% against it in one process (docs/performance.md). Larger "
        "batches and prefills run without it. [preset, else on for engines with unquantized "
        "or FP8 weights on sm_90+ targets; INT4 AWQ engines: opt-in]",
    ),
    fused_norms: bool = typer.Option(
        None,
        "--fused-norms/--no-fused-norms",
        help="Fold the residual add + RMSNorm into the decode GEMVs of small batches (GPU "
        "targets; unquantized, FP8 and INT4 engines, tp 1): the GEMV before each norm adds into the "
        "residual stream, the one after normalizes as it loads, two kernel launches fewer per "
        "layer. Slower on an H200 so far: BF16 batch-1 decode 237-240 tok/s against 255 "
        "without it in one process (Llama-3.1-8B shapes; docs/performance.md). [preset, else off]",
    ),
    fp8_fast_accum: bool = typer.Option(
        None,
        "--fp8-fast-accum/--no-fp8-fast-accum",
        help="FP8 engines (and FP8 lm_heads): let cuBLASLt's FP8 GEMMs (prefill chunks, "
        "large decode batches) accumulate in the tensor cores alone, without promoting partial "
        "sums to full fp32 every few K steps: ~6-10% faster GEMMs on an H100, but slower at "
        "some sizes, so a build on the target GPU times both modes per GEMM and uses it on "
        "the row counts where it wins (a cross-build: from 512 rows). Less exact over long inner "
        "dimensions; the checkpoint's accuracy report is measured without it. GPU targets. "
        "[preset, else off]",
    ),
    force: bool = typer.Option(
        False, "--force", help="Replace an existing engine in --output-dir."
    ),
    max_kl: float = typer.Option(
        None,
        "--max-kl",
        help="Refuse to build when the quantized checkpoint's accuracy report has a mean KL "
        "divergence (nats, vs the unquantized model) above this.",
    ),
) -> None:
    """Build an engine for one target from a checkpoint (written atomically)."""
    from ingot.compiler.build import build_engine
    from ingot.runtime.engine import read_engine_config

    overrides = {
        "max_batch_size": max_batch_size,
        "max_seq_len": max_seq_len,
        "max_num_tokens": max_num_tokens,
        "tokens_per_block": tokens_per_block,
        "pdl": pdl,
        "fused_norms": fused_norms,
        "fp8_fast_accum": fp8_fast_accum,
    }
    with progress_bar() as progress:
        out = build_engine(
            checkpoint_dir,
            output_dir,
            preset=config,
            overrides=overrides,
            target=target,
            force=force,
            progress=progress,
            tactics=tactics,
            max_kl=max_kl,
        )
    typer.echo(f"engine written to {out}")
    b = read_engine_config(out).build
    if b.max_num_tokens < b.max_batch_size:
        typer.echo(
            f"note: --max-num-tokens {b.max_num_tokens} is below --max-batch-size "
            f"{b.max_batch_size}: a step computes at most {b.max_num_tokens} tokens, so at most "
            f"that many sequences decode at once and prompts prefill {b.max_num_tokens} tokens "
            "per step; rebuild with a larger --max-num-tokens for throughput",
            err=True,
        )
