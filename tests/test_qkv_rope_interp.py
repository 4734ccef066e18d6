"""The QKV GEMV with RoPE and the KV write in its epilogue (plugins/gemm/qkv_rope.py), run on
the CPU by Triton's interpreter: the same bits as the GEMV then the RoPE + KV-write kernel,
and the CPU reference within bf16 tolerance (tests/kernel_checks.py). Also on the GPU:
tests/test_gpu_gemv.py.

NOTE: TRITON_INTERPRET must be set before the kernel modules are imported, so the suite's one
test re-runs this module in a fresh process with the interpreter on (as
test_quant_kernels_interp.py does).
"""

from __future__ import annotations

import os

import pytest
from interp_rerun import rerun_with_interpreter

if os.environ.get("TRITON_INTERPRET") != "1":

    def test_qkv_rope_in_the_triton_interpreter():
        rerun_with_interpreter(__file__)

else:
    import torch
    import triton_interp_compat  # noqa: F401  (Triton interpreter vs NumPy 2.4)
    from kernel_checks import fp8_qkv_rope_fused_vs_unfused, qkv_rope_fused_vs_unfused

    from ingot.plugins import pdl
    from ingot.plugins.gemm import qkv_rope

    F8 = torch.float8_e4m3fn
    # n2 (one dim pair per program), n4 with unroll, n8 (the widest)
    TACTICS = [
        next(t for t in qkv_rope.QKV_ROPE_TACTICS if t.as_dict()["block_n"] == n) for n in (2, 4, 8)
    ]

    CASES = [
        (1, 4, 2, 16, torch.bfloat16, False),
        (1, 2, 1, 32, F8, True),
        (2, 4, 1, 16, torch.bfloat16, True),  # two rows of x: tactics with max_m >= 2
    ]
    PARAMS = [(t, *c) for t in TACTICS for c in CASES if c[0] <= t.as_dict()["max_m"]]

    @pytest.mark.parametrize("tactic,T,heads,kv_heads,hd,kv_dtype,bias", PARAMS)
    def test_qkv_rope_equals_gemv_then_rope(tactic, T, heads, kv_heads, hd, kv_dtype, bias):
        qkv_rope_fused_vs_unfused(tactic, T, heads, kv_heads, hd, kv_dtype, bias)

    # FP8 weights (plugin fp8_qkv_rope_gemm): n2 and n4 tactics (16 fp8 a load)
    FP8_TACTICS = [
        next(t for t in qkv_rope.FP8_QKV_ROPE_TACTICS if t.as_dict()["block_n"] == n)
        for n in (2, 4)
    ]
    FP8_PARAMS = [(t, *c) for t in FP8_TACTICS for c in CASES if c[0] <= t.as_dict()["max_m"]]

    @pytest.mark.parametrize("tactic,T,heads,kv_heads,hd,kv_dtype,bias", FP8_PARAMS)
    def test_fp8_qkv_rope_equals_fp8_gemv_then_rope(tactic, T, heads, kv_heads, hd, kv_dtype,
                                                    bias):  # fmt: skip
        fp8_qkv_rope_fused_vs_unfused(tactic, T, heads, kv_heads, hd, kv_dtype, bias, K=512)

    def test_fp8_qkv_rope_pdl_variant_same_bits():
        tactic = FP8_TACTICS[0]
        plain = fp8_qkv_rope_fused_vs_unfused(tactic, 1, 4, 2, 16, F8, K=512)
        with pdl.scope(True):
            again = fp8_qkv_rope_fused_vs_unfused(tactic, 1, 4, 2, 16, F8, K=512)
        for a, b in zip(plain["fused"], again["fused"], strict=True):
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))

    def test_qkv_rope_pdl_variant_same_bits():
        tactic = TACTICS[0]
        plain = qkv_rope_fused_vs_unfused(tactic, 1, 4, 2, 16, torch.bfloat16)
        with pdl.scope(True):
            again = qkv_rope_fused_vs_unfused(tactic, 1, 4, 2, 16, torch.bfloat16)
        for a, b in zip(plain["fused"], again["fused"], strict=True):
            assert torch.equal(a, b)

    def test_qkv_rope_unfusable_calls_take_the_unfused_path():
        tactic = TACTICS[2]  # n8: 4 dims of a pair-half per program; hd 4 has 2
        x = torch.randn(1, 64, dtype=torch.bfloat16)
        w = torch.randn((4 + 2 * 2) * 4, 64, dtype=torch.bfloat16)
        assert not qkv_rope.fusable(x, w, None, 4, 2, tactic.as_dict())
        assert not qkv_rope.fusable(x.float(), w.float(), None, 4, 2, TACTICS[0].as_dict())
        assert qkv_rope.fusable(x, w, None, 4, 2, TACTICS[0].as_dict())
        # FP8 weights: x FP8 with a model-dtype output, or normed on load; not bf16 x as is
        w8, x8 = w.to(F8), x.to(F8)
        fp8_t = FP8_TACTICS[0].as_dict()
        assert qkv_rope.fusable(x8, w8, None, 4, 2, fp8_t, out_dtype=torch.bfloat16)
        assert not qkv_rope.fusable(x8, w8, None, 4, 2, fp8_t)  # an FP8 q: no
        assert not qkv_rope.fusable(x, w8, None, 4, 2, fp8_t)
