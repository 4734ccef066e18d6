"""`ingot run-engine`."""

from __future__ import annotations

import re
from pathlib import Path

import typer

from ingot.runtime.errors import ConfigError
from ingot.runtime.user_files import read_user_text

# SamplingParams fields -> the run-engine flags that set them (for error messages)
_FLAGS = {
    "max_new_tokens": "--max-output-len",
    "temperature": "--temperature",
    "top_k": "--top-k",
    "top_p": "--top-p",
    "repetition_penalty": "--repetition-penalty",
}


def _read_prompts(texts: list[str] | None, input_file: Path | None) -> list[str]:
    prompts = list(texts or [])
    if input_file is not None:
        text = read_user_text(
            input_file, f"--input-file {input_file}", "pass a UTF-8 text file, one prompt a line"
        )
        prompts += [line for line in text.splitlines() if line.strip()]
    if not prompts:
        raise ConfigError("no prompt given", "pass --input-text TEXT or --input-file FILE")
    return prompts


def run_engine_cmd(
    engine_dir: Path = typer.Option(
        ..., "--engine-dir", help="Engine dir written by build-engine."
    ),
    input_text: list[str] = typer.Option(
        None, "--input-text", help="A prompt; repeat for several (served together)."
    ),
    input_file: Path = typer.Option(
        None, "--input-file", help="A text file with one prompt per line."
    ),
    max_output_len: int = typer.Option(..., "--max-output-len", help="Most new tokens per prompt."),
    temperature: float = typer.Option(0.0, "--temperature", help="0 is greedy."),
    top_k: int = typer.Option(
        0, "--top-k", help="Keep the k most likely tokens (0: off; 1: greedy)."
    ),
    top_p: float = typer.Option(1.0, "--top-p", help="Nucleus sampling mass (1.0: off)."),
    repetition_penalty: float = typer.Option(
        1.0, "--repetition-penalty", help="> 1 discourages repeats."
    ),
    seed: int = typer.Option(
        None, "--seed", help="Seed for sampling; the same seed gives the same text."
    ),
    stop_words: list[str] = typer.Option(
        None, "--stop-words", help="Stop when the output contains this text; repeatable."
    ),
    streaming: bool = typer.Option(False, "--streaming", help="Print text as it is generated."),
    num_kv_blocks: int = typer.Option(
        None,
        "--num-kv-blocks",
        help="KV-cache blocks (default: enough for max-batch-size full sequences).",
    ),
    kv_fraction: float = typer.Option(
        0.9,
        "--kv-cache-free-gpu-memory-fraction",
        help="GPU engines: share of the memory left after weights and activations that the KV "
        "cache takes.",
    ),
    policy: str = typer.Option(
        "guaranteed_no_evict", "--scheduler-policy", help="guaranteed_no_evict or max_utilization."
    ),
    no_pipeline: bool = typer.Option(
        False,
        "--no-pipeline",
        help="Read each step's tokens back before launching the next (default: greedy steps "
        "overlap the host's work with the next step on the device; the tokens are the same).",
    ),
) -> None:
    """Load an engine and generate text for all prompts with inflight batching (a
    tensor-parallel engine runs one process per rank)."""
    from ingot.runtime.llm import LLM
    from ingot.runtime.types import FinishReason, SamplingParams

    prompts = _read_prompts(input_text, input_file)
    if policy not in ("guaranteed_no_evict", "max_utilization"):
        raise ConfigError(
            f"unknown --scheduler-policy {policy!r}", "use guaranteed_no_evict or max_utilization"
        )
    try:
        params = SamplingParams(
            max_new_tokens=max_output_len,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            repetition_penalty=repetition_penalty,
            seed=seed,
            stop_words=tuple(stop_words or ()),
        )
    except ValueError as e:  # named by its flag, not by the SamplingParams field
        msg = str(e)
        for field, flag in _FLAGS.items():
            msg = re.sub(rf"^{field}\b", flag, msg)
        raise ConfigError(msg) from None
    llm = LLM(
        engine_dir,
        num_kv_blocks=num_kv_blocks,
        policy=policy,
        kv_fraction=kv_fraction,
        pipeline=not no_pipeline,
    )

    def on_text(i: int, delta: str) -> None:
        typer.echo(f"[{i}] +{delta!r}" if len(prompts) > 1 else delta, nl=len(prompts) > 1)

    max_seq_len = llm.engine.config.build.max_seq_len
    try:
        outs = llm.generate(prompts, params, on_text if streaming else None)
    finally:
        llm.close()  # tp > 1: stops the other ranks
    if streaming and len(prompts) == 1:
        typer.echo("")
    failed = 0
    for i, c in enumerate(outs):
        if c.error:
            failed += 1
            # NOTE: the executor's message starts with its own request id; the prompt's index here
            msg = re.sub(r"^request \d+: ", "", c.error)
            typer.echo(f"error: request {i}: {msg}", err=True)
            continue
        typer.echo(f"[{i}] Input: {c.prompt!r}")
        typer.echo(
            f"[{i}] Output: {c.text!r}  ({len(c.token_ids)} tokens, {c.finish_reason.name.lower()})"
        )
        if c.finish_reason == FinishReason.LENGTH and len(c.token_ids) < max_output_len:
            typer.echo(
                f"note: request {i} reached the engine's max_seq_len ({max_seq_len} tokens with "
                f"the prompt) before --max-output-len {max_output_len}; rebuild with a larger "
                "--max-seq-len for longer outputs",
                err=True,
            )
    if failed:
        raise typer.Exit(2)
