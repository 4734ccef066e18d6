"""`ingot bench`."""

from __future__ import annotations

from pathlib import Path

import typer

from ingot.runtime.errors import ConfigError


def _csv(value: str | None, kind: type, flag: str) -> tuple:
    if not value:
        return ()
    try:
        out = tuple(kind(v) for v in value.replace(" ", "").split(",") if v)
    except ValueError:
        raise ConfigError(f"{flag} {value!r} is not a comma-separated list of numbers") from None
    if any(v <= 0 for v in out):
        raise ConfigError(f"{flag} values must be > 0, got {value!r}")
    return out


def bench_cmd(
    mode: str = typer.Argument(
        None,
        metavar="MODE",
        help="latency (batch 1: TTFT, inter-token latency, decode tok/s), throughput (all "
        "requests at once: output/total tok/s, requests/s) or serve (Poisson arrivals per "
        "request rate, streamed: TTFT/ITL p50/p90/p99). Not needed with --grid.",
    ),
    engine_dir: Path = typer.Option(
        ..., "--engine-dir", help="Engine dir written by build-engine."
    ),
    output_dir: Path = typer.Option(
        Path("bench-results"),
        "--output-dir",
        help="Folder for MODE.json, MODE.md and MODE.png (grid: grid-standard.*).",
    ),
    input_len: int = typer.Option(128, "--input-len", help="Prompt tokens per request."),
    output_len: int = typer.Option(
        128, "--output-len", help="Generated tokens per request (EOS ignored)."
    ),
    num_requests: int = typer.Option(
        None,
        "--num-requests",
        help="Requests per point (default: latency 5, throughput the batch size, serve 32).",
    ),
    batch_sizes: str = typer.Option(
        None,
        "--batch-sizes",
        help="throughput: comma-separated sweep, e.g. 1,8,64 (at most that many requests in "
        "flight; default: the engine's max_batch_size).",
    ),
    request_rates: str = typer.Option(
        None, "--request-rates", help="serve: requests/s, comma-separated (default 2,8,32)."
    ),
    dataset: Path = typer.Option(
        None,
        "--dataset",
        help='throughput/serve: JSONL, one {"input_len": N, "output_len": M} (or "prompt_ids") '
        "a line, instead of fixed lengths.",
    ),
    shared_prefix_len: int = typer.Option(
        0,
        "--shared-prefix-len",
        help="Leading prompt tokens common to all requests (prefix cache).",
    ),
    seed: int = typer.Option(
        0, "--seed", help="Workload seed: same seed, same token ids, lengths and arrivals."
    ),
    baseline: str = typer.Option(
        None,
        "--baseline",
        help="hf: also run transformers eager generate on the same workload and report ratios.",
    ),
    hf_model_dir: Path = typer.Option(
        None,
        "--hf-model-dir",
        help="Source HF model for the baseline (default: rebuilt from the engine's own weights; "
        "needed for quantized engines).",
    ),
    hf_num_requests: int = typer.Option(
        None,
        "--hf-num-requests",
        help="Run the baseline on only the first N requests of each point (ratios use rates and "
        "per-request latencies, so they stay comparable).",
    ),
    hf_max_output_len: int = typer.Option(
        None,
        "--hf-max-output-len",
        help="Stop the baseline's requests after N output tokens (rates stay comparable; "
        "--grid standard uses 128 on its long-output points).",
    ),
    grid: str = typer.Option(
        None,
        "--grid",
        help="standard: the H200 grid (latency b1; throughput 128/128, 128/2048, 2048/128, "
        "2048/2048; serve at 4, 16, 64 req/s) in one run, into one folder.",
    ),
    num_kv_blocks: int = typer.Option(
        None, "--num-kv-blocks", help="KV-cache blocks (default: sized by the runtime)."
    ),
    policy: str = typer.Option(
        "guaranteed_no_evict", "--scheduler-policy", help="guaranteed_no_evict or max_utilization."
    ),
    no_prefix_reuse: bool = typer.Option(
        False, "--no-prefix-reuse", help="Turn off KV prefix reuse."
    ),
    kv_fraction: float = typer.Option(
        0.9,
        "--kv-cache-free-gpu-memory-fraction",
        help="GPU: share of free memory for the KV cache.",
    ),
    no_cuda_graphs: bool = typer.Option(
        False, "--no-cuda-graphs", help="GPU: do not replay decode steps from CUDA graphs."
    ),
    no_pipeline: bool = typer.Option(
        False,
        "--no-pipeline",
        help="Read each step's tokens back before launching the next (default: greedy steps "
        "overlap the host's work with the next step on the device).",
    ),
    force: bool = typer.Option(False, "--force", help="Replace existing result files."),
) -> None:
    """Benchmark an engine: latency, throughput or serving, with optional HF baseline and roofline."""
    from ingot.cli.bench import MODES, Options, check_outputs, markdown, run_bench, write_all

    if grid is None and mode is None:
        raise ConfigError("no MODE given", f"pass one of {', '.join(MODES)}, or --grid standard")
    if grid is not None and mode is not None:
        raise ConfigError(f"pass either MODE ({mode}) or --grid, not both")
    if mode is not None and mode not in MODES:
        raise ConfigError(f"unknown mode {mode!r}", f"choose one of {', '.join(MODES)}")
    if policy not in ("guaranteed_no_evict", "max_utilization"):
        raise ConfigError(
            f"unknown --scheduler-policy {policy!r}", "use guaranteed_no_evict or max_utilization"
        )
    for flag, v in (
        ("--input-len", input_len),
        ("--output-len", output_len),
        ("--num-requests", num_requests),
        ("--hf-num-requests", hf_num_requests),
        ("--hf-max-output-len", hf_max_output_len),
    ):
        if v is not None and v <= 0:
            raise ConfigError(f"{flag} must be > 0, got {v}")
    if dataset is not None and mode == "latency":
        raise ConfigError("--dataset applies to throughput and serve, not latency")
    options = Options(
        mode=mode or "grid",
        input_len=input_len,
        output_len=output_len,
        num_requests=num_requests,
        batch_sizes=_csv(batch_sizes, int, "--batch-sizes"),
        request_rates=_csv(request_rates, float, "--request-rates"),
        dataset=dataset,
        shared_prefix_len=shared_prefix_len,
        seed=seed,
        hf_num_requests=hf_num_requests,
        hf_max_output_len=hf_max_output_len,
    )
    paths = check_outputs(output_dir, f"grid-{grid}" if grid else mode, force)
    doc = run_bench(
        engine_dir,
        options,
        grid=grid,
        baseline=baseline,
        hf_model_dir=hf_model_dir,
        executor_kwargs={
            "num_kv_blocks": num_kv_blocks,
            "policy": policy,
            "enable_prefix_reuse": not no_prefix_reuse,
            "kv_cache_free_gpu_memory_fraction": kv_fraction,
            "cuda_graphs": not no_cuda_graphs,
            "pipeline": not no_pipeline,
        },
        log=lambda msg: typer.echo(msg, err=True),
    )
    write_all(doc, paths)
    typer.echo(markdown(doc))
    typer.echo(f"wrote {', '.join(str(p) for p in paths.values())}")
