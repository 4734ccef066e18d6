"""One benchmark invocation: every point on ingot, then (optionally) every point on the
Hugging Face baseline, then ratios, in one process on one device.

ingot goes first with one Executor for all points; it is freed before the baseline model is
loaded, so each side has the device to itself (and its own peak-memory figure).
"""

from __future__ import annotations

import platform
import time
from collections.abc import Callable
from pathlib import Path

import torch

from ingot.runtime.engine import check_device, read_engine_config
from ingot.runtime.errors import ConfigError
from ingot.runtime.memory import kv_bytes_per_token
from ingot.runtime.version import INGOT_VERSION

from .hf_model import check_hf_dir
from .ingot_driver import IngotDriver
from .metrics import compare, summarize
from .points import Options, Point, build_points
from .roofline import Roofline, decode_weight_bytes, measure_bandwidth
from .workload import Workload, synthetic

SCHEMA = "ingot-bench"
SCHEMA_VERSION = 1
BASELINES = ("hf",)
Log = Callable[[str], None]


def _device_info(device: torch.device) -> dict:
    if device.type == "cuda":
        return {
            "type": "cuda",
            "name": torch.cuda.get_device_name(device),
            "torch": torch.__version__,
        }
    return {
        "type": "cpu",
        "name": platform.processor() or platform.machine(),
        "torch": torch.__version__,
    }


def _warmup(driver, vocab_size: int, max_seq_len: int) -> None:
    """A short untimed run: first-call costs (allocator, kernels, graphs) stay out of figures."""
    w = synthetic(2, max(1, min(16, max_seq_len // 2)), 4, vocab_size, seed=2**31 - 1)
    driver.run(w)


def warm_workload(p: Point, build, vocab_size: int, limit: int | None = None) -> Workload:
    """Untimed requests to run before point `p`: as many of its longest prompts as one step
    takes (the token budget, the batch, the point's concurrency and size; `limit`: the
    baseline's share of the point), two output tokens each, fresh token ids (no prefix cached
    for the point). First-use costs of a step of that shape (GEMM heuristics at its rows,
    allocator growth, graph capture) stay out of the point's figures, on both sides. One request
    warmed only one prompt's rows; the H200's first 8,192-token step of 128/128 then took 212 ms
    against ~100 for the later ones (how much of that is first use rather than the pipeline
    filling: see docs/performance.md)."""
    n = max(it.input_len for it in p.workload.items)
    k = min(len(p.workload), p.max_concurrency or build.max_batch_size)
    k = min(k, max(1, build.max_num_tokens // n))
    if limit is not None:
        k = max(1, min(k, limit))
    return synthetic(k, n, 2, vocab_size, seed=2**31 - 2)


def run_bench(
    engine_dir: Path,
    options: Options,
    *,
    grid: str | None = None,
    baseline: str | None = None,
    hf_model_dir: Path | None = None,
    device: torch.device | None = None,
    executor_kwargs: dict | None = None,
    log: Log = lambda _msg: None,
) -> dict:
    """Run the points and return the result document (see report.py for its layout)."""
    if baseline not in (None, *BASELINES):
        raise ConfigError(f"unknown --baseline {baseline!r}", f"choose {', '.join(BASELINES)}")
    if hf_model_dir is not None and baseline is None:
        raise ConfigError("--hf-model-dir needs --baseline hf")
    cfg = read_engine_config(Path(engine_dir))
    m, b = cfg.model, cfg.build
    points = build_points(options, m, b, grid)
    if hf_model_dir is not None:
        check_hf_dir(hf_model_dir, m)
    device = device or torch.device("cpu" if cfg.target == "cpu" else "cuda")
    check_device(cfg, device)  # before the bandwidth is measured on it
    log(f"measuring {device.type} bandwidth")
    bw = measure_bandwidth(device)
    log(f"loading engine {engine_dir}")
    t = time.perf_counter()
    ours = IngotDriver(Path(engine_dir), device, **(executor_kwargs or {}))
    load = {"load_s": time.perf_counter() - t, "load_phases_s": ours.executor.load_seconds}
    roof = Roofline(
        decode_weight_bytes(ours.weights, m),
        kv_bytes_per_token(m, ours.kv_element_size),
        bw["bytes_per_s"],
    )
    results = [{**p.describe(), "ingot": None, "hf": None, "vs_hf": None} for p in points]
    _warmup(ours, m.vocab_size, b.max_seq_len)
    for p, r in zip(points, results, strict=True):
        ours.run(warm_workload(p, b, m.vocab_size))
        t = time.perf_counter()
        r["ingot"] = summarize(ours.run(p.workload, p.max_concurrency), roof)
        log(f"ingot {p.name}: {time.perf_counter() - t:.1f} s")
    engine = ours.engine
    ours.close()
    del ours
    if baseline == "hf":
        _run_hf(engine, points, results, roof, hf_model_dir, device, log)
    return {
        "schema": SCHEMA,
        "schema_version": SCHEMA_VERSION,
        "ingot_version": INGOT_VERSION,
        "created_unix": time.time(),
        "mode": options.mode if grid is None else f"grid:{grid}",
        "engine": {
            "dir": str(engine_dir),
            "architecture": m.architecture,
            "family": m.family,
            "dtype": m.dtype,
            "quant": cfg.quant.mode,
            "target": cfg.target,
            "build": b.to_dict(),
            **load,
            # how the executor served it (defaults unless the command line changed them)
            "executor": {
                k: v for k, v in (executor_kwargs or {}).items() if k in ("cuda_graphs", "pipeline")
            },
        },
        "device": _device_info(device),
        "seed": options.seed,
        "bandwidth": bw,
        "roofline": roof.to_dict(),
        "baseline": None if baseline is None else _baseline_info(hf_model_dir),
        "results": results,
    }


def _baseline_info(hf_model_dir: Path | None) -> dict:
    import transformers

    return {
        "name": "hf",
        "what": "transformers eager generate, greedy, static batches of arrived requests",
        "weights": str(hf_model_dir) if hf_model_dir else "rebuilt from the engine's weights",
        "transformers": transformers.__version__,
        "ratio_basis": (
            "rates (tok/s, req/s) and per-request latencies, so a baseline that ran only its "
            "first hf_num_requests requests, or outputs capped at hf_max_output_len tokens, "
            "stays comparable"
        ),
    }


def _run_hf(engine, points: list[Point], results: list[dict], roof, hf_dir, device, log) -> None:
    from .hf_baseline import HFDriver
    from .hf_model import model_from_dir, model_from_engine

    cfg = engine.config
    log("loading the transformers baseline")
    if hf_dir is not None:
        model = model_from_dir(Path(hf_dir), cfg.model, device)
    else:
        model = model_from_engine(engine.weights(), cfg.model, cfg.quant.mode, device)
    hf = HFDriver(model, device, cfg.build.max_batch_size)
    _warmup(hf, cfg.model.vocab_size, cfg.build.max_seq_len)
    for p, r in zip(points, results, strict=True):
        hf.run(warm_workload(p, cfg.build, cfg.model.vocab_size, p.hf_num_requests))
        t = time.perf_counter()
        r["hf"] = summarize(hf.run(p.hf_workload(), p.max_concurrency), roof)
        r["vs_hf"] = compare(p.mode, r["ingot"], r["hf"], p.hf_outputs_capped)
        log(f"hf {p.name}: {time.perf_counter() - t:.1f} s")
    hf.close()
