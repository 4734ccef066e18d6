"""FP8 engines built on the GPU: the rows on which each FP8 GEMM runs cuBLASLt's
fast-accumulation mode (build-engine --fp8-fast-accum) and the rows it pads come from timing
both modes at the engine's row counts (`compiler/fast_accum.py`). Timings are faked here; the
GPU build is in test_gpu_quant_e2e."""

from __future__ import annotations

import pytest
from model_shapes import LLAMA_3_1_8B

from ingot.compiler.fast_accum import (
    fast_rows_from,
    pad_rows_from,
    timed_rows,
    with_cublaslt_choices,
)
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
    # and 3,000 rounded up to a multiple of 128: what it runs padded
    assert timed_rows(small, "attn.o") == [16, 32, 64, 128, 256, 512, 1024, 2048, 3000, 3072]
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

    out = with_cublaslt_choices(_choices(), LLAMA_3_1_8B, BUILD, time_fn)
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
    # 448 rows run promoted (1.0), 512 fast (0.9): 385-448 run padded to 512, nothing else
    pads = {k: (c.params or {}).get("pad_rows") for k, c in by.items()}
    assert pads.pop(("fp8_gemm", "mlp.gate_up")) == "385-448"
    assert set(pads.values()) == {None}
    rows = timed_rows(BUILD, "mlp.gate_up")
    assert len(calls) == 4 * len(rows) and len(set(calls)) == len(calls)


@pytest.mark.parametrize(
    ("slow", "where"),
    [
        ({448}, "385-448"),
        ({16, 24, 448}, "16-24,385-448"),
        ({192, 320}, "129-192,257-320"),
        ({128, 512}, None),  # multiples of 128: nothing to pad to
        (set(), None),
    ],
)
def test_pad_rows_are_those_of_the_sizes_slower_than_their_padded_size(slow, where):
    """A size not a multiple of 128 stands for its rows as in `fast_rows_from`, and pads them
    when its padded size (timed too) was faster by the margin; a padded size not timed, or
    within the margin, pads nothing."""
    rows = [16, 24, 64, 128, 192, 256, 320, 384, 448, 512]
    times = {r: 1.2 if r in slow else 1.0 for r in rows}
    assert pad_rows_from(times) == where
    assert pad_rows_from({r: 1.0 for r in rows} | {448: 1.015}) is None  # within 2%
    assert pad_rows_from({448: 2.0, 384: 1.0}) is None  # 512 not timed


def test_without_the_flag_a_gpu_build_pads_and_keeps_full_promotion():
    """An FP8 engine built on the GPU without --fp8-fast-accum: the same timings choose its
    padded rows, from the promoted mode's, and no GEMM gets fast accumulation however fast."""
    n_gate_up = _sites()["mlp.gate_up"][0]

    def time_fn(rows, n, k):
        slow = n == n_gate_up and rows == 448
        return (1.3 if slow else 1.0, 0.5)

    out = with_cublaslt_choices(_choices(), LLAMA_3_1_8B, BUILD, time_fn, fast_accum=False)
    for c in out:
        params = c.params or {}
        assert "fast_accum" not in params and "fast_accum_rows" not in params, c
        gate_up = (c.name, c.site) == ("fp8_gemm", "mlp.gate_up")
        assert params.get("pad_rows") == ("385-448" if gate_up else None), c
    assert by_site(out)["mlp.gate_up"].timings_ms["promoted@rows448"] == 1.3


def by_site(choices):
    return {c.site: c for c in choices if c.name == "fp8_gemm"}


def test_without_timings_every_fp8_gemm_gets_the_fixed_floor():
    out = with_cublaslt_choices(_choices())
    for c in out:
        fp8 = c.name != "rms_norm_quant_fp8"
        assert bool((c.params or {}).get("fast_accum")) == fp8
        assert "fast_accum_min_rows" not in (c.params or {})


def _sites():
    from ingot.compiler.tactic_select import gemm_sites

    return gemm_sites(LLAMA_3_1_8B)
