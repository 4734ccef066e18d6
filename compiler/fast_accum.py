"""cuBLASLt's FP8 GEMMs, per GEMM and row count: fast accumulation (build-engine
--fp8-fast-accum) and padded rows, where a build on the target GPU timed them faster.

Fast accumulation (`torch._scaled_mm(use_fast_accum=True)`) is not faster at every size: on the
H100 it took 10% off Llama-3.1-8B's layer GEMMs at 8,192 rows and 6.4% at 512, but cuBLASLt's
pick for gate_up at 448 rows ran 34% slower (docs/performance.md, 2026-12-06); the H200 build
of 2026-12-06 timed gate_up 43% slower with it at 448 rows and 10% faster at 512. So a build on
the target GPU times both modes per GEMM at the row counts the engine runs (its decode graph
buckets and powers of two from FAST_ACCUM_TIMED_FROM rows up to max_num_tokens, and those
rounded up to `row_room.PAD_ROWS_TO`), each size in two rounds of opposite order, and runs fast
accumulation on the rows each timed size stands for (those above the next smaller timed size,
up to it) where it was faster by FAST_ACCUM_MARGIN: `fast_accum_rows` ("lo-hi" ranges,
`row_room.row_ranges`). A GEMM where it never won keeps full promotion. A cross-build
(no GPU) records the plugin's fixed floor (`cuda_fp8.FAST_ACCUM_MIN_ROWS`).

The same timings choose `pad_rows`: cuBLASLt's pick at some row counts is slower than at more
rows (gate_up at 448 rows: 101.9 us against 82.0 at 512 on the H200, 120.8 against 85.2 on the
H100), so a size that is not a multiple of PAD_ROWS_TO runs padded up to one where that size,
in the mode it runs, was faster by the margin (`pad_rows_from`). Every FP8 engine built on a GPU
gets these; fast accumulation only with the flag.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from ingot.plugins.quant.row_room import in_ranges, padded_rows, row_ranges
from ingot.runtime.config import BuildConfig, ModelConfig
from ingot.runtime.engine import PluginChoice

# the plugins whose large-batch path is `cuda_fp8.make_fp8_linear`'s cuBLASLt call -> the GEMM
# site whose shape they run (None: the choice's own site)
FP8_CUBLASLT_PLUGINS = {"fp8_gemm": None, "fp8_swiglu_gemm": "mlp.down",
                        "fp8_qkv_rope_gemm": "attn.qkv"}  # fmt: skip
# fewer rows mostly run the decode GEMVs, not cuBLASLt
FAST_ACCUM_TIMED_FROM = 16
# how much faster fast accumulation must be at a size to be used there: the two modes were
# 1-3% apart from run to run where neither had the edge (H200 build, 2026-12-06)
FAST_ACCUM_MARGIN = 0.02

# (rows, N, K) -> (ms with fp32 promotion, ms with fast accumulation)
TimeFn = Callable[[int, int, int], tuple[float, float]]


def timed_rows(build: BuildConfig, site: str) -> list[int]:
    """The row counts at which the build times both modes of the GEMM at `site`: the decode
    graph buckets, and powers of two up to max_num_tokens and itself (prefill chunks and mixed
    steps) except for the lm_head (it runs only the sampling rows, at most one a sequence);
    each also rounded up to a multiple of PAD_ROWS_TO."""
    from ingot.runtime.cuda_graphs import batch_buckets

    rows = batch_buckets(build.max_batch_size)
    top = build.max_batch_size if site == "lm_head" else build.max_num_tokens
    rows += [1 << i for i in range(top.bit_length()) if 1 << i < top] + [top]
    rows = [r for r in rows if FAST_ACCUM_TIMED_FROM <= r <= top]
    return sorted({*rows, *map(padded_rows, rows)})  # and what a padded GEMM runs


def ranges_of(timed: list[int], wins: set[int]) -> str | None:
    """The rows the winning sizes of `timed` stand for: each those above the next smaller
    timed size up to itself (the smallest for itself alone); adjacent ranges are merged.
    "lo-hi,lo-hi" (`row_room.row_ranges`), or None where none won."""
    ranges: list[list[int]] = []
    prev = None
    for rows in sorted(timed):
        lo = rows if prev is None else prev + 1
        if rows in wins:
            if ranges and ranges[-1][1] == lo - 1:
                ranges[-1][1] = rows
            else:
                ranges.append([lo, rows])
        prev = rows
    return ",".join(f"{a}-{b}" for a, b in ranges) or None


def faster(ms: float, than: float) -> bool:
    return ms < than * (1 - FAST_ACCUM_MARGIN)


def fast_rows_from(times: dict[int, tuple[float, float]]) -> str | None:
    """The rows where fast accumulation runs, from each timed size's (promoted ms, fast ms):
    those of the sizes where it was faster by FAST_ACCUM_MARGIN (`ranges_of`)."""
    return ranges_of(
        list(times), {r for r, (promoted, fast) in times.items() if faster(fast, promoted)}
    )


def pad_rows_from(times: dict[int, float]) -> str | None:
    """The rows that run padded to a multiple of PAD_ROWS_TO, from each timed size's ms in the
    mode it runs: those of the sizes whose padded size (timed too) was faster by the margin."""
    wins = {r for r in times if padded_rows(r) in times and faster(times[padded_rows(r)], times[r])}
    return ranges_of(list(times), wins)


def pad_rows_of(times: dict[int, tuple[float, float]], fast_where: str | None) -> str | None:
    """`pad_rows_from` on each timed size's (promoted ms, fast ms) in the mode it runs: fast
    on the rows of `fast_where` (`fast_accum_rows`, None: nowhere)."""
    on = row_ranges(fast_where) if fast_where else []
    return pad_rows_from({r: t[1] if in_ranges(on, r) else t[0] for r, t in times.items()})


def site_of(choice: PluginChoice) -> str | None:
    return FP8_CUBLASLT_PLUGINS[choice.name] or choice.site


def with_cublaslt_choices(
    choices: list[PluginChoice],
    model: ModelConfig | None = None,
    build: BuildConfig | None = None,
    time_fn: TimeFn | None = None,
    progress: Callable[[str, int, int], None] | None = None,
    fast_accum: bool = True,
) -> list[PluginChoice]:
    """The FP8 GEMM plugins' tactics with fast accumulation (`fast_accum`: the flag) and padded
    rows where they won (every such choice names a tactic: these plugins have GPU candidates).
    time_fn (a build on the target GPU, with model and build): each GEMM's shape is timed at
    `timed_rows` and its choice records the timings (`promoted@rowsR`, `fast_accum@rowsR`),
    `fast_accum_rows` (`fast_rows_from`; no fast accumulation where it never won) and
    `pad_rows` (`pad_rows_from`, where padding won); without it, `fast_accum` alone (the
    plugin's fixed floor)."""
    from ingot.compiler.tactic_select import gemm_sites

    sites = gemm_sites(model) if model is not None else {}
    measured: dict[str, dict[int, tuple[float, float]]] = {}
    out = []
    for c in choices:
        if c.name not in FP8_CUBLASLT_PLUGINS:
            out.append(c)
            continue
        params = {**(c.params or {}), **({"fast_accum": 1} if fast_accum else {})}
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
                        progress(f"timing cuBLASLt ({site})", i + 1, len(rows))
            # decided on the timings as recorded, so the plugin table reproduces its choices
            times = {r: (round(p, 5), round(f, 5)) for r, (p, f) in measured[site].items()}
            for r, (promoted, fast) in times.items():
                timings[f"promoted@rows{r}"] = promoted
                timings[f"fast_accum@rows{r}"] = fast
            where = fast_rows_from(times) if fast_accum else None
            if where is None:
                params.pop("fast_accum", None)
            else:
                params["fast_accum_rows"] = where
            pad = pad_rows_of(times, where)
            if pad is not None:
                params["pad_rows"] = pad
        out.append(dataclasses.replace(c, params=params, timings_ms=timings or None))
    return out


def gpu_time_fn(repeats: int = 30, rounds: int = 2) -> TimeFn:
    """Both modes of cuBLASLt's FP8 GEMM on this GPU, x already quantized as the engine's
    norm and SwiGLU kernels hand it over (checked against the plain-torch op first): the mean
    of `rounds` timings, each round in the other order (a mode timed second ran slower in
    some sizes than the same mode timed first)."""
    import torch

    from ingot.plugins import get_spec
    from ingot.plugins.quant import cuda_fp8
    from ingot.plugins.registry import Tactic, import_attr
    from ingot.plugins.tactics import time_tactics

    promoted = cuda_fp8.FP8_GEMM_TACTICS[0]  # a cuBLASLt tactic: no GEMV rows
    fast = cuda_fp8.fast_accum_tactic(Tactic(promoted.name + "_fast", promoted.params), "1-")
    reference = import_attr(get_spec("fp8_gemm").impls["cpu"])(None)

    def time_fn(rows: int, n: int, k: int) -> tuple[float, float]:
        def inputs():
            f8 = torch.float8_e4m3fn
            x = (torch.randn(rows, k, device="cuda") * 0.1).to(f8)
            w = (torch.randn(n, k, device="cuda") * 0.1).to(f8)
            scales = [torch.tensor(s, device="cuda") for s in (0.01, 0.02)]
            return (x, w, *scales, None), {"out_dtype": torch.bfloat16}

        total = {promoted: 0.0, fast: 0.0}
        for i in range(rounds):
            order = (promoted, fast) if i % 2 == 0 else (fast, promoted)
            check = dict(reference=reference, tolerance=5e-2) if i == 0 else {}
            res = time_tactics("fp8_gemm", order, inputs, repeats, cuda_fp8.make_fp8_linear,
                               **check)  # fmt: skip
            for t, ms in res:
                total[t] += ms / rounds
        torch.cuda.empty_cache()
        return total[promoted], total[fast]

    return time_fn
