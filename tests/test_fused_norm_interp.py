"""RMSNorm folded into the decode GEMVs (plugins/gemm/fused_norm.py), run on the CPU by
Triton's interpreter against the unfused kernels (tests/fused_norm_checks.py; on the GPU:
tests/test_gpu_gemv.py).

NOTE: TRITON_INTERPRET must be set before the kernel modules are imported, so the suite's one
test re-runs this module in a fresh process with the interpreter on.
"""

from __future__ import annotations

import os

import pytest
from interp_rerun import rerun_with_interpreter

if os.environ.get("TRITON_INTERPRET") != "1":

    def test_fused_norm_in_the_triton_interpreter():
        rerun_with_interpreter(__file__)

else:
    import triton_interp_compat  # noqa: F401  (Triton interpreter vs NumPy 2.4)
    from fused_norm_checks import (
        add_out_then_norm_in,
        fallbacks_match,
        fp8_norm_in_quantizes_after_the_norm,
        large_sums_take_the_coarse_sum,
        qkv_rope_norm_in,
        sums_do_not_depend_on_the_programs,
        swiglu_down_adds,
        w4a16_folds,
    )

    @pytest.mark.parametrize("T", [1, 2])
    @pytest.mark.parametrize("use_pdl", [False, True])
    def test_add_out_then_norm_in_equals_the_norm_kernel(T, use_pdl):
        add_out_then_norm_in(T, 96, 256, "cpu", use_pdl)

    def test_sums_are_the_same_bits_every_time():
        sums_do_not_depend_on_the_programs("cpu")

    @pytest.mark.filterwarnings("ignore:invalid value encountered in cast")  # the fine sum's
    def test_large_sums_take_the_coarse_sum():
        large_sums_take_the_coarse_sum("cpu")

    def test_calls_the_gemv_does_not_take_give_the_same():
        fallbacks_match("cpu")

    @pytest.mark.parametrize("T", [1, 2])
    def test_swiglu_down_adds_into_the_residual(T):
        swiglu_down_adds(T, "cpu")

    @pytest.mark.parametrize("T", [1, 2])
    def test_fp8_gemv_quantizes_after_the_folded_norm(T):
        fp8_norm_in_quantizes_after_the_norm(T, "cpu")

    @pytest.mark.parametrize("T", [1, 2])
    @pytest.mark.parametrize("fp8", [False, True])
    def test_qkv_rope_gemv_normalizes_as_it_loads(T, fp8):
        qkv_rope_norm_in(T, "cpu", fp8)

    @pytest.mark.parametrize(
        "T,packed,use_pdl", [(1, False, False), (2, False, True), (1, True, False)]
    )
    def test_w4a16_gemvs_fold_the_norms(T, packed, use_pdl):
        w4a16_folds(T, "cpu", packed, use_pdl)
