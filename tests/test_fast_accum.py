"""build-engine --fp8-fast-accum on the GPU: the rows from which each FP8 GEMM runs cuBLASLt's
fast-accumulation mode come from timing both modes at the engine's row counts
(`compiler/fast_accum.py`). Timings are faked here; the GPU build is in test_gpu_quant_e2e."""

from __future__ import annotations

import pytest
from model_shapes import LLAMA_3_1_8B

from ingot.compiler.fast_accum import fast_rows_from, timed_rows, with_fp8_fast_accum
from ingot.runtime.config import BuildConfig
from ingot.runtime.engine import PluginChoice

BUILD = BuildConfig(max_batch_size=512, max_num_tokens=8192, target="sm_90")


def test_timed_rows_are_the_decode_buckets_and_prefill_chunks():
    rows = timed_rows(BUILD, "mlp.gate_up")
    decode = [16, 24, 32, 40, 48, 56, 64, 128, 192, 256, 320, 384, 448, 512]
    assert rows == sorted({*decode, 1024, 2048, 4096, 8192})
    # the lm_head runs the sampling rows only: at most one per sequence
    assert timed_rows(BUILD, "lm_head") == decode
    small = BuildConfig(max_batch_size=8, max_num_tokens=3000, target="sm_90")
    assert timed_rows(small, "attn.o") == [16, 32, 64, 128, 256, 512, 1024, 2048, 3000]
    assert timed_rows(small, "lm_head") == []


@pytest.mark.parametrize(
    ("fast_wins", "where"),
    [
        ({128, 448, 512, 8192}, "128-8192"),
        ({128, 512, 8192}, "128-128,449-8192"),  # the H100's gate_up: slower at 448 rows
        ({448, 8192}, "129-448,513-8192"),
        ({8192}, "513-8192"),
        ({128, 448, 512}, "128-512"),
        (set(), None),
    ],
)
def test_fast_rows_are_those_each_winning_size_stands_for(fast_wins, where):
    """Each timed size stands for the rows above the next smaller one up to itself; fast
    accumulation runs there when it was faster by the margin, and not on a tie or within it."""
    times = {r: (1.0, 0.9 if r in fast_wins else 1.1) for r in (128, 448, 512, 8192)}
    assert fast_rows_from(times) == where
    assert fast_rows_from({r: (1.0, 1.0) for r in times}) is None
    assert fast_rows_from({r: (1.0, 0.985) for r in times}) is None  # within the 2% margin
    assert fast_rows_from({r: (1.0, 0.97) for r in times}) == "128-8192"


def _choices() -> list[PluginChoice]:
    gemv = {"max_m": 1, "block_k": 2048}
    return [
        PluginChoice("fp8_gemm", 1, "gemv", gemv, None),
        *(
            PluginChoice("fp8_gemm", 1, "gemv", gemv, s, {"gemv": 0.02})
            for s in ("attn.qkv", "attn.o", "mlp.gate_up", "mlp.down")
        ),  # fmt: skip
        PluginChoice("fp8_swiglu_gemm", 1, "gemv", gemv, None),
        PluginChoice("fp8_qkv_rope_gemm", 1, "gemv", gemv, None),
        PluginChoice("rms_norm_quant_fp8", 1, "w4", {"num_warps": 4}, None),
    ]


def test_each_gemm_records_its_timed_floor_and_the_timings():
    """gate_up loses at 448 rows, the down projection wins everywhere, the o projection
    never wins (no fast accumulation); the fused plugins take the rows of the shape they run;
    each shape is timed once at each size."""
    n_of = {site: n for site, (n, _, _) in _sites().items()}
    calls = []

    def time_fn(rows, n, k):
        calls.append((rows, n, k))
        if n == n_of["mlp.gate_up"]:
            return (1.0, 1.3 if rows == 448 else 0.9)
        if n == n_of["attn.o"] and k == LLAMA_3_1_8B.q_size:
            return (1.0, 1.2)
        return (1.0, 0.95)

    out = with_fp8_fast_accum(_choices(), LLAMA_3_1_8B, BUILD, time_fn)
    by = {(c.name, c.site): c for c in out}
    where = {k: (c.params or {}).get("fast_accum_rows") for k, c in by.items()}
    fast = {k: bool((c.params or {}).get("fast_accum")) for k, c in by.items()}
    assert where[("fp8_gemm", "mlp.gate_up")] == "16-384,449-8192"
    assert where[("fp8_gemm", "mlp.down")] == where[("fp8_swiglu_gemm", None)] == "16-8192"
    assert where[("fp8_gemm", "attn.qkv")] == where[("fp8_qkv_rope_gemm", None)] == "16-8192"
    assert not fast[("fp8_gemm", "attn.o")] and not fast[("rms_norm_quant_fp8", None)]
    # the site-less fp8_gemm choice: no shape to time, so the plugin's fixed floor
    assert fast[("fp8_gemm", None)] and where[("fp8_gemm", None)] is None
    gate_up = by[("fp8_gemm", "mlp.gate_up")]
    assert gate_up.timings_ms["gemv"] == 0.02  # the decode tactic's timing is kept
    assert gate_up.timings_ms["fast_accum@rows448"] == 1.3
    assert gate_up.timings_ms["promoted@rows448"] == 1.0
    assert gate_up.params["max_m"] == 1  # the tactic itself is unchanged
    rows = timed_rows(BUILD, "mlp.gate_up")
    assert len(calls) == 4 * len(rows) and len(set(calls)) == len(calls)


def test_without_timings_every_fp8_gemm_gets_the_fixed_floor():
    out = with_fp8_fast_accum(_choices())
    for c in out:
        fp8 = c.name != "rms_norm_quant_fp8"
        assert bool((c.params or {}).get("fast_accum")) == fp8
        assert "fast_accum_min_rows" not in (c.params or {})


def _sites():
    from ingot.compiler.tactic_select import gemm_sites

    return gemm_sites(LLAMA_3_1_8B)
