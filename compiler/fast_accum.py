"""build-engine --fp8-fast-accum: where cuBLASLt's fast-accumulation mode is faster, per GEMM.

Fast accumulation (`torch._scaled_mm(use_fast_accum=True)`) is not faster at every size: on the
H100 it took 10% off Llama-3.1-8B's layer GEMMs at 8,192 rows and 6.4% at 512, but cuBLASLt's
pick for gate_up at 448 rows ran 34% slower (docs/performance.md, 2026-12-06). So a build on
the target GPU times both modes per GEMM at the row counts the engine runs (its decode graph
buckets and powers of two from FAST_ACCUM_TIMED_FROM rows up to max_num_tokens) and records
the smallest row count from which fast accumulation won at every timed size above it
(`fast_accum_min_rows`); a GEMM where it lost at the largest size keeps full promotion. A
cross-build (no GPU) records the plugin's fixed floor (`cuda_fp8.FAST_ACCUM_MIN_ROWS`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from ingot.runtime.config import BuildConfig, ModelConfig
from ingot.runtime.engine import PluginChoice

# the plugins whose large-batch path is `cuda_fp8.make_fp8_linear`'s cuBLASLt call -> the GEMM
# site whose shape they run (None: the choice's own site)
FP8_CUBLASLT_PLUGINS = {"fp8_gemm": None, "fp8_swiglu_gemm": "mlp.down",
                        "fp8_qkv_rope_gemm": "attn.qkv"}  # fmt: skip
# fewer rows mostly run the decode GEMVs, not cuBLASLt
FAST_ACCUM_TIMED_FROM = 16

# (rows, N, K) -> (ms with fp32 promotion, ms with fast accumulation)
TimeFn = Callable[[int, int, int], tuple[float, float]]


def timed_rows(build: BuildConfig, site: str) -> list[int]:
    """The row counts at which the build times both modes of the GEMM at `site`: the decode
    graph buckets, and powers of two up to max_num_tokens and itself (prefill chunks and mixed
    steps) except for the lm_head (it runs only the sampling rows, at most one a sequence)."""
    from ingot.runtime.cuda_graphs import batch_buckets

    rows = batch_buckets(build.max_batch_size)
    top = build.max_batch_size if site == "lm_head" else build.max_num_tokens
    rows += [1 << i for i in range(top.bit_length()) if 1 << i < top] + [top]
    return sorted({r for r in rows if FAST_ACCUM_TIMED_FROM <= r <= top})


def min_rows_from(times: dict[int, tuple[float, float]]) -> int | None:
    """The smallest timed row count from which fast accumulation was faster at every timed
    count (promoted ms, fast ms); None when it was not faster at the largest."""
    floor = None
    for rows in sorted(times, reverse=True):
        promoted, fast = times[rows]
        if not fast < promoted:
            break
        floor = rows
    return floor


def site_of(choice: PluginChoice) -> str | None:
    return FP8_CUBLASLT_PLUGINS[choice.name] or choice.site


def with_fp8_fast_accum(
    choices: list[PluginChoice],
    model: ModelConfig | None = None,
    build: BuildConfig | None = None,
    time_fn: TimeFn | None = None,
    progress: Callable[[str, int, int], None] | None = None,
) -> list[PluginChoice]:
    """The FP8 GEMM plugins' tactics with fast accumulation where it won (every such choice
    names a tactic: these plugins have GPU candidates, and the flag needs a GPU target).
    time_fn (a build on the target GPU, with model and build): each GEMM's shape is timed at
    `timed_rows` and its choice records `fast_accum_min_rows` and the timings
    (`promoted@rowsR`, `fast_accum@rowsR`), or no fast accumulation where it never won;
    without it, `fast_accum` alone (the plugin's fixed floor)."""
    from ingot.compiler.tactic_select import gemm_sites

    sites = gemm_sites(model) if model is not None else {}
    measured: dict[str, dict[int, tuple[float, float]]] = {}
    out = []
    for c in choices:
        if c.name not in FP8_CUBLASLT_PLUGINS:
            out.append(c)
            continue
        params = {**(c.params or {}), "fast_accum": 1}
        timings = dict(c.timings_ms or {})
        site = site_of(c)
        if time_fn is not None and build is not None and site in sites:
            if site not in measured:
                n, k, _ = sites[site]
                rows = timed_rows(build, site)
                measured[site] = {}
                for i, r in enumerate(rows):
                    measured[site][r] = time_fn(r, n, k)
                    if progress:
                        progress(f"timing fast accumulation ({site})", i + 1, len(rows))
            times = measured[site]
            for r, (promoted, fast) in times.items():
                timings[f"promoted@rows{r}"] = round(promoted, 5)
                timings[f"fast_accum@rows{r}"] = round(fast, 5)
            floor = min_rows_from(times)
            if floor is None:
                params.pop("fast_accum")
            else:
                params["fast_accum_min_rows"] = floor
        out.append(dataclasses.replace(c, params=params, timings_ms=timings or None))
    return out


def gpu_time_fn(repeats: int = 30) -> TimeFn:
    """Both modes of cuBLASLt's FP8 GEMM on this GPU, x already quantized as the engine's
    norm and SwiGLU kernels hand it over; each checked against the plain-torch op first."""
    import torch

    from ingot.plugins import get_spec
    from ingot.plugins.quant import cuda_fp8
    from ingot.plugins.registry import Tactic, import_attr
    from ingot.plugins.tactics import time_tactics

    promoted = cuda_fp8.FP8_GEMM_TACTICS[0]  # a cuBLASLt tactic: no GEMV rows
    fast = cuda_fp8.fast_accum_tactic(Tactic(promoted.name + "_fast", promoted.params), 1)

    reference = import_attr(get_spec("fp8_gemm").impls["cpu"])(None)

    def time_fn(rows: int, n: int, k: int) -> tuple[float, float]:
        def inputs():
            f8 = torch.float8_e4m3fn
            x = (torch.randn(rows, k, device="cuda") * 0.1).to(f8)
            w = (torch.randn(n, k, device="cuda") * 0.1).to(f8)
            scales = [torch.tensor(s, device="cuda") for s in (0.01, 0.02)]
            return (x, w, *scales, None), {"out_dtype": torch.bfloat16}

        res = dict(time_tactics("fp8_gemm", (promoted, fast), inputs, repeats,
                                cuda_fp8.make_fp8_linear, reference=reference,
                                tolerance=5e-2))  # fmt: skip
        torch.cuda.empty_cache()
        return res[promoted], res[fast]

    return time_fn
