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
    from kernel_checks import (
        fp8_qkv_rope_fused_vs_unfused,
        qkv_rope_fused_vs_unfused,
        w4a16_qkv_rope_fused_vs_unfused,
    )

    from ingot.plugins import pdl
    from ingot.plugins.gemm import qkv_rope
    from ingot.plugins.quant import triton_w4a16 as tw
    from ingot.plugins.quant import w4a16_qkv_rope as wq

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

    # INT4 AWQ weights (plugin w4a16_qkv_rope_gemm): the fp32 loop (n8, and n2 with max_m 2)
    # and the packed one (bf16 x)
    W4_FP32 = [t for t in tw.DECODE_TACTICS if not t.as_dict().get("packed")]
    W4_DEC = [W4_FP32[0], next(t for t in W4_FP32 if t.as_dict()["block_n"] == 2)]
    W4_DEC.append(next(t for t in tw.DECODE_TACTICS if t.as_dict().get("packed")))
    W4_PARAMS = [
        (tw.combine_tactics(d, tw.GEMM_TACTICS[0]), *c)
        for d in W4_DEC
        for c in CASES
        if c[0] <= d.as_dict()["max_m"] and c[3] % d.as_dict()["block_n"] == 0
    ]

    @pytest.mark.parametrize("tactic,T,heads,kv_heads,hd,kv_dtype,bias", W4_PARAMS,
                             ids=lambda v: getattr(v, "name", None))  # fmt: skip
    def test_w4a16_qkv_rope_equals_w4a16_gemv_then_rope(tactic, T, heads, kv_heads, hd,
                                                        kv_dtype, bias):  # fmt: skip
        packed = "packed" in tw._split_params(tactic)[0]
        dtype = torch.bfloat16 if packed else torch.float16
        w4a16_qkv_rope_fused_vs_unfused(tactic, T, heads, kv_heads, hd, kv_dtype, bias,
                                        dtype=dtype, pqs=T == 1)  # fmt: skip

    def test_w4a16_qkv_rope_pdl_variant_same_bits():
        tactic = tw.combine_tactics(W4_DEC[0], tw.GEMM_TACTICS[0])
        plain = w4a16_qkv_rope_fused_vs_unfused(tactic, 1, 4, 2, 16, F8, dtype=torch.float16)
        with pdl.scope(True):
            again = w4a16_qkv_rope_fused_vs_unfused(tactic, 1, 4, 2, 16, F8, dtype=torch.float16)
        for a, b in zip(plain["fused"], again["fused"], strict=True):
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))

    def test_w4a16_qkv_rope_takes_what_its_gemv_takes():
        """Past the tactic's max_m rows, fp64 x, or a head half the program's rows do not
        divide: the W4A16 plugin then the RoPE kernel (same results, other launches)."""
        from ingot.plugins.quant import reference as qref

        dec = W4_FP32[0].as_dict()  # n8: 4 dims of a pair-half per program
        assert dec["block_n"] == 8
        qw = qref.pack_w4_engine(torch.randint(0, 16, ((4 + 2 * 2) * 16, 128)))
        ws = torch.full((qw.shape[0], 1), 0.01, dtype=torch.float16)
        x = torch.randn(1, 128, dtype=torch.float16)
        args = (qw, ws, None, 128, None, None, 4, 2)
        assert wq.fusable(x, *args, dec)
        assert not wq.fusable(torch.randn(2, 128, dtype=torch.float16), *args, dec)
        assert wq.fusable(x.float(), qw, ws.float(), None, 128, None, None, 4, 2, dec)
        x64, ws64 = x.double(), ws.double()
        assert not wq.fusable(x64, qw, ws64, None, 128, None, None, 4, 2, dec)
        qw4 = qref.pack_w4_engine(torch.randint(0, 16, ((4 + 2 * 2) * 4, 128)))  # hd 4
        assert not wq.fusable(x, qw4, ws[: qw4.shape[0]], None, 128, None, None, 4, 2, dec)

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
