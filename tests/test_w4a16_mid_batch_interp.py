"""The W4A16 medium-batch half (`triton_w4a16.MID_TACTICS`: the split-K GEMM, the tensor-core
GEMV with more x tiles) under Triton's interpreter: values against the reference (and the
unsplit GEMM, the fp64 product), and which rows reach it.

NOTE: the interpreter's bf16 `tl.dot` multiplies raw bits, so values are checked in fp16 and
fp32 here (bf16 on the GPU: tests/test_gpu_quant.py); bf16 calls only check the routing.
"""

from __future__ import annotations

import os

import pytest
from interp_rerun import rerun_with_interpreter

if os.environ.get("TRITON_INTERPRET") != "1":

    def test_w4a16_mid_batch_in_the_triton_interpreter():
        rerun_with_interpreter(__file__)

else:
    import torch
    import triton_interp_compat  # noqa: F401  (Triton interpreter vs NumPy 2.4)
    from kernel_checks import rel_err
    from w4_cases import Spy, w4_case

    from ingot.plugins.quant import triton_w4a16 as tw
    from ingot.plugins.quant import w4a16_mma as wm

    def _run(args, params, decode=False, dtype=None):
        x, qweight, scales, p, b = args
        out = torch.full((x.shape[0], qweight.shape[0]), float("nan"), dtype=dtype or x.dtype)
        assert tw.kernel_ok(x, qweight, scales, p, 128, None, b, int(params.get("block_k", 128)))
        return tw.launch_w4a16(x, qweight, scales, p, 128, b, out, params, decode)

    MMA_X = [t for t in tw.MID_TACTICS if t.as_dict().get("mma")]

    @pytest.mark.parametrize("tactic", [MMA_X[0], MMA_X[2]], ids=lambda t: t.name)
    def test_mma_gemv_with_more_x_tiles(tactic, monkeypatch):
        """The tensor-core GEMV with 2 or 4 x tiles of 8 rows (one pass over the weights for
        all): without pre_quant_scale, its fp32 sums within fp32 rounding of the fp64
        product of x and the dequantized weight; with it and bias, the reference within 1e-2;
        rows filling the last x tile partly, all of them, and past what one launch takes (a
        second pass on the rows after)."""
        from ingot.plugins.quant import reference as qref

        torch.manual_seed(23)
        launched = []
        monkeypatch.setattr(wm, "_w4a16_mma_gemv_kernel", Spy(wm._w4a16_mma_gemv_kernel, launched))
        params = tactic.as_dict()
        R = tw.mma_rows(params)
        assert R == 8 * params["xtiles"] > 8
        for K, N, T, pqs, bias in ((256, 40, R - 3, False, True), (384, 32, R, True, True),
                                   (256, 24, R + 5, False, False)):  # fmt: skip
            args, ref = w4_case(K, N, T, torch.bfloat16, bias, pqs)
            x, qweight, scales, p, b = args
            if pqs:
                assert rel_err(_run(args, params, True), ref) < 1e-2, (K, N, T)
                continue
            sums = _run(args, params, True, torch.float32)  # before the interpreter's bf16 cast
            exact = x.double() @ qref.dequantize_w4(qweight, scales, 128).double().t()
            exact += b.double() if bias else 0.0
            assert (sums.double() - exact).abs().max() < 1e-5 * exact.abs().max(), (K, N, T)
        assert [kw["XTILES"] for kw in launched] == [params["xtiles"]] * 4  # 1 + 1 + 2 passes

    @pytest.mark.parametrize("split", [2, 4])
    @pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
    def test_split_k_gemm_sums_the_runs_of_k(split, dtype):
        """Each K split's fp32 partial sums, added by the second kernel: within 1e-2 of the
        reference and equal to the unsplit GEMM up to fp32 summation order (fp32 x), the same
        bits on a second run; K of 3 blocks over 4 splits leaves one empty; rows past a
        BLOCK_M tile, N past a BLOCK_N one, with and without bias and pre_quant_scale."""
        torch.manual_seed(20)
        params = dict(tw.MID_TACTICS[0].as_dict(), split_k=split, block_n=32)
        plain = {k: v for k, v in params.items() if k != "split_k"}
        for T, K, bias, pqs in ((9, 384, True, True), (17, 256, False, True), (3, 384, True, 0)):
            args, ref = w4_case(K, 40, T, dtype, bias, pqs)
            out = _run(args, params)
            assert rel_err(out, ref) < 1e-2, (T, K, split)
            assert torch.equal(out, _run(args, params)), (T, K, split)  # a fixed order
            if dtype == torch.float32:
                assert rel_err(out, _run(args, plain)) < 1e-5, (T, K, split)

    def test_split_k_gemm_writes_each_partial_once(monkeypatch):
        """The GEMM launch has split_k programs a tile and writes a [split_k, T, N] fp32 buffer
        the sum kernel reads whole: poisoned, no NaN reaches the output."""
        torch.manual_seed(21)
        launched = []
        monkeypatch.setattr(tw, "_w4a16_mm_kernel", Spy(tw._w4a16_mm_kernel, launched))
        empty = torch.empty

        def poisoned(*shape, **kw):  # the partial sums' buffer: NaN
            t = empty(*shape, **kw)
            return t.fill_(float("nan")) if t.dtype == torch.float32 and t.dim() == 3 else t

        monkeypatch.setattr(torch, "empty", poisoned)
        params = [t for t in tw.MID_TACTICS if t.as_dict().get("split_k")][1].as_dict()
        args, ref = w4_case(512, 72, 5, torch.float16, True)
        assert rel_err(_run(args, params), ref) < 1e-2
        assert [kw["SPLIT_K"] for kw in launched] == [params["split_k"]]
        assert launched[0]["BLOCK_M"] == 16 < params["block_m"]  # tiles as tall as 5 rows need
        assert launched[0]["HAS_BIAS"] is False  # the bias is added once, by the sum kernel

    def test_w4a16_mid_batch_half_takes_the_rows_past_the_small_one(monkeypatch):
        """combine_tactics(dec, mm, small, mid): 1 row runs the GEMV, 2-8 rows of bf16 x the
        tensor-core GEMV, 9-64 rows the split-K GEMM (SwiGLU before it for the down
        projection), 65 rows the GEMM half; without a small half the mid one takes from 2
        rows (fp16 x, which the tensor-core GEMV does not take, too); without a mid half 9
        rows run the GEMM."""
        from ingot.plugins.activation.triton_kernels import make_swiglu

        torch.manual_seed(22)
        mma, sums = [], []
        monkeypatch.setattr(wm, "_w4a16_mma_gemv_kernel", Spy(wm._w4a16_mma_gemv_kernel, mma))
        monkeypatch.setattr(tw, "_split_k_sum_kernel", Spy(tw._split_k_sum_kernel, sums))
        dec, mm, mid = tw.DECODE_TACTICS[0], tw.GEMM_TACTICS[0], tw.MID_TACTICS[0]
        fn = tw.make_w4a16_linear(tw.combine_tactics(dec, mm, tw.SMALL_TACTICS[0], mid))
        for T, runs in ((1, (0, 0)), (8, (1, 0)), (9, (1, 1)), (64, (1, 2)), (65, (1, 2))):
            args, _ = w4_case(256, 40, T, torch.bfloat16, True, pqs=False)
            fn(*args[:4], 128, None, args[4])
            assert (len(mma), len(sums)) == runs, T
        gate_up = torch.randn(16, 512).to(torch.float16)
        _, qweight, scales, pqs, _ = args
        gated = fn(gate_up, qweight, scales, pqs, 128, gated=True)
        assert len(sums) == 3
        assert torch.equal(gated, fn(make_swiglu(None)(gate_up), qweight, scales, pqs, 128))
        alone = tw.make_w4a16_linear(tw.combine_tactics(dec, mm, None, mid))
        for T, dt in ((2, torch.bfloat16), (5, torch.float16)):
            args, ref = w4_case(256, 40, T, dt, True, pqs=False)
            out = alone(*args[:4], 128, None, args[4])
            assert dt == torch.bfloat16 or rel_err(out, ref) < 1e-2
        assert (len(mma), len(sums)) == (1, 6)
        pair = tw.make_w4a16_linear(tw.combine_tactics(dec, mm, tw.SMALL_TACTICS[0]))
        args, _ = w4_case(256, 40, 9, torch.bfloat16, True, pqs=False)
        pair(*args[:4], 128, None, args[4])
        assert (len(mma), len(sums)) == (1, 6)
        # a tensor-core mid half (32 rows a launch): bf16 x of 9-64 rows in passes of 32;
        # fp16 x and 65 rows the GEMM
        x4 = MMA_X[2]
        assert tw.mma_rows(x4.as_dict()) == 32
        fn = tw.make_w4a16_linear(tw.combine_tactics(dec, mm, tw.SMALL_TACTICS[0], x4))
        for T, dt, runs in ((9, torch.bfloat16, 2), (64, torch.bfloat16, 4),
                            (65, torch.bfloat16, 4), (20, torch.float16, 4)):  # fmt: skip
            args, _ = w4_case(256, 16, T, dt, False, pqs=False)
            fn(*args[:4], 128)
            assert (len(mma), len(sums)) == (runs, 6), T
