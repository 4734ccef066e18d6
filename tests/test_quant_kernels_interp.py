"""Quantized GPU kernels (FP8 quantize/GEMM, W4A16, FP8 KV cache attention) against their CPU
references, run on the CPU by Triton's interpreter.

NOTE: TRITON_INTERPRET is read when a `@triton.jit` kernel module is imported, so it must not
leak into the rest of the suite (other modules import the same kernels for the AOT dry run).
In the suite, the one test below re-runs this module in a fresh process with the interpreter
on; there (TRITON_INTERPRET=1) the real checks are collected. The interpreter's bf16 `tl.dot`
multiplies raw bits (numpy), so dot paths are checked in fp16/fp32 here and in bf16 on the GPU
(tests/test_gpu_quant.py).
"""

from __future__ import annotations

import os

import pytest
from interp_rerun import rerun_with_interpreter

if os.environ.get("TRITON_INTERPRET") != "1":
    # four shards, ~200 s each on the CI machine kind (822 s in one process, 2026-12-07)
    @pytest.mark.parametrize("shard", [f"{i}/4" for i in range(4)])
    def test_quant_kernels_in_the_triton_interpreter(shard):
        rerun_with_interpreter(__file__, shard)

else:
    import torch
    import triton
    import triton_interp_compat  # noqa: F401  (Triton interpreter vs NumPy 2.4)
    from kernel_checks import (
        fp8_hard_values,
        new_v_stored_by_attention,
        rel_err,
        rope_fp8_write_fused_vs_unfused,
        same_bits,
        w4a16_packed_model,
    )
    from w4_cases import Spy as _Spy
    from w4_cases import w4_case as _w4_case

    from ingot.plugins import pdl
    from ingot.plugins.attention import reference as attn_ref
    from ingot.plugins.attention import triton_decode as dec
    from ingot.plugins.attention import triton_kv_write as kvw
    from ingot.plugins.attention import triton_prefill as pf
    from ingot.plugins.attention.layout import is_transposed, v_like
    from ingot.plugins.quant import cuda_fp8
    from ingot.plugins.quant import reference as qref
    from ingot.plugins.quant import triton_quantize as tq
    from ingot.plugins.quant import triton_w4a16 as tw
    from ingot.plugins.registry import Tactic
    from ingot.plugins.rope import reference as rope_ref
    from ingot.plugins.rope import triton_kernels as rope_gpu

    F8 = torch.float8_e4m3fn

    # ------------------------------------------------------------------ FP8 quantize and GEMM

    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
    @pytest.mark.parametrize("scale", [1.0, 0.37, 3.5])
    def test_quantize_fp8_bit_exact(dtype, scale):
        torch.manual_seed(0)
        v = fp8_hard_values()
        x = v[: v.numel() // 101 * 101].to(dtype).reshape(-1, 101)  # odd row length
        s = torch.tensor(scale)
        for tactic in tq.QUANTIZE_TACTICS:
            out = tq.quantize_fp8(x, s, tactic=tactic)
            assert same_bits(out, qref.quantize_fp8(x, s)), tactic.name
            assert has_padded_room(out)

    @pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
    @pytest.mark.parametrize("residual", [False, True])
    def test_rms_norm_quant_fp8(dtype, residual):
        torch.manual_seed(1)
        x, r = torch.randn(5, 96).to(dtype), torch.randn(5, 96).to(dtype)
        w = (1 + 0.1 * torch.randn(96)).to(dtype)
        s = torch.tensor(0.02)
        if residual:
            out, new_r = tq.rms_norm_quant_fp8(x, w, 1e-5, s, r)
            ref, ref_r = qref.rms_norm_quant_fp8(x, w, 1e-5, s, r)
            assert torch.equal(new_r, ref_r)
        else:
            out, ref = tq.rms_norm_quant_fp8(x, w, 1e-5, s), qref.rms_norm_quant_fp8(x, w, 1e-5, s)
        # the norm's sum order may move a value by one ulp of the activation dtype
        assert (out.view(torch.uint8) != ref.view(torch.uint8)).float().mean() < 0.02
        assert rel_err(out.float(), ref.float()) < 5e-2
        assert has_padded_room(out)

    @pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
    def test_swiglu_quant_fp8(dtype):
        torch.manual_seed(2)
        x = torch.randn(3, 2 * 77).to(dtype)
        s = torch.tensor(0.01)
        out = tq.swiglu_quant_fp8(x, s, block=32)
        ref = qref.swiglu_quant_fp8(x, s)
        assert (out.view(torch.uint8) != ref.view(torch.uint8)).float().mean() < 0.02
        assert rel_err(out.float(), ref.float()) < 5e-2
        assert has_padded_room(out)

    def has_padded_room(out: torch.Tensor) -> bool:
        """The quantizing kernels' output has room for the rows an FP8 GEMM may pad it to
        (`row_room`)."""
        from ingot.plugins.quant.row_room import padded_rows

        t, d = out.shape
        return out.untyped_storage().nbytes() == padded_rows(t) * d

    @pytest.mark.parametrize("bias", [False, True])
    @pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
    def test_fp8_linear(bias, dtype):
        torch.manual_seed(3)
        for K, N, T in ((128, 37, 1), (256, 48, 5), (128, 64, 3)):
            x = torch.randn(T, K).to(dtype)
            w = torch.randn(N, K) * 0.05
            w_scale = w.abs().max() / 448
            weight = qref.quantize_fp8(w, w_scale)
            in_scale = x.float().abs().max() / 448
            b = torch.randn(N).to(dtype) if bias else None
            ref = qref.fp8_linear(x, weight, w_scale, in_scale, b)
            for tactic in (None, *cuda_fp8.FP8_GEMM_TACTICS):
                out = cuda_fp8.make_fp8_linear(tactic)(x, weight, w_scale, in_scale, b)
                assert out.dtype == dtype and rel_err(out, ref.float()) < 5e-2
            xq = tq.quantize_fp8(x, in_scale)
            out = cuda_fp8.make_fp8_linear(None)(xq, weight, w_scale, in_scale, b, out_dtype=dtype)
            assert rel_err(out, ref.float()) < 5e-2

    FP8_GEMVS = [t for t in cuda_fp8.FP8_GEMM_TACTICS if t.as_dict().get("max_m")]

    @pytest.mark.parametrize("tactic", FP8_GEMVS, ids=lambda t: t.name)
    @pytest.mark.parametrize("out_dtype", [torch.float32, torch.float16])
    def test_fp8_gemv(tactic, out_dtype, monkeypatch):
        """The GEMV takes x of up to max_m rows (already FP8, as the fused kernels give it),
        with a K tail past BLOCK_K and N past BLOCK_N; the sum is the reference's fp32 one."""
        launched = []
        real = cuda_fp8.launch_gemv
        monkeypatch.setattr(cuda_fp8, "launch_gemv", lambda *a: launched.append(1) or real(*a))
        torch.manual_seed(4)
        max_m = tactic.as_dict()["max_m"]
        K, N = tactic.as_dict()["block_k"] + 48, 37
        w = torch.randn(N, K) * 0.05
        ws, xs = w.abs().max() / 448, torch.tensor(0.02)
        weight, b = qref.quantize_fp8(w, ws), torch.randn(N).to(out_dtype)
        fn = cuda_fp8.make_fp8_linear(tactic)
        for T in range(1, max_m + 2):
            xq = tq.quantize_fp8(torch.randn(T, K), xs)
            ref = qref.fp8_matmul(xq, weight, ws, xs, b, out_dtype)
            out = fn(xq, weight, ws, xs, b, out_dtype=out_dtype)
            assert out.dtype == out_dtype
            assert rel_err(out, ref) < (1e-5 if out_dtype == torch.float32 else 2e-3), T
            with pdl.scope(True):  # weight chunk 0 loaded before the wait: the same sums
                assert torch.equal(fn(xq, weight, ws, xs, b, out_dtype=out_dtype), out), T
        assert len(launched) == 2 * max_m  # T = max_m + 1 took the other path

    @pytest.mark.parametrize("tactic", FP8_GEMVS, ids=lambda t: t.name)
    def test_fp8_swiglu_gemv(tactic, monkeypatch):
        """SwiGLU-quantize folded into the FP8 down projection's GEMV: the same bits as the
        SwiGLU-quantize kernel then the FP8 GEMV, and the reference's values."""
        gated = []
        real = cuda_fp8.launch_gemv
        monkeypatch.setattr(
            cuda_fp8, "launch_gemv", lambda *a, **kw: gated.append(a[5]) or real(*a, **kw)
        )  # a[5]: gated
        torch.manual_seed(5)
        max_m = tactic.as_dict()["max_m"]
        inter, N = tactic.as_dict()["block_k"] + 48, 37
        w = torch.randn(N, inter) * 0.05
        ws, xs = w.abs().max() / 448, torch.tensor(0.004)
        weight, b = qref.quantize_fp8(w, ws), torch.randn(N).to(torch.float16)
        fused = cuda_fp8.make_fp8_swiglu_linear(tactic)
        for T in range(1, max_m + 2):
            gate_up = torch.randn(T, 2 * inter).to(torch.float16)
            out = fused(gate_up, weight, ws, xs, b)
            act = tq.make_swiglu_quant_fp8(None)(gate_up, xs)
            unfused = cuda_fp8.make_fp8_linear(tactic)(act, weight, ws, xs, b, out_dtype=out.dtype)
            assert out.dtype == torch.float16 and torch.equal(out, unfused), T
            with pdl.scope(True):
                assert torch.equal(fused(gate_up, weight, ws, xs, b), out), T
            ref = qref.fp8_swiglu_linear(gate_up, weight, ws, xs, b)
            assert rel_err(out, ref) < 2e-2, T  # fp16 SwiGLU rounding flips some fp8 steps
        assert gated.count(True) == 2 * max_m  # the folded GEMV ran for T <= max_m only

    # ------------------------------------------------------------------ W4A16

    def _w4_run(args, params, decode):
        x, qweight, scales, p, b = args
        out = torch.full((x.shape[0], qweight.shape[0]), float("nan"), dtype=x.dtype)
        assert tw.kernel_ok(x, qweight, scales, p, 128, None, b, int(params.get("block_k", 128)))
        return tw.launch_w4a16(x, qweight, scales, p, 128, b, out, params, decode)

    @pytest.mark.parametrize("K", [128, 256])
    @pytest.mark.parametrize("N", [37, 48])
    @pytest.mark.parametrize("bias", [False, True])
    def test_w4a16_shapes(K, N, bias):
        torch.manual_seed(4)
        dec_p, mm_p = tw.DECODE_TACTICS[0].as_dict(), tw.GEMM_TACTICS[0].as_dict()
        for T in range(1, 6):
            for dtype in (torch.bfloat16, torch.float16, torch.float32):
                args, ref = _w4_case(K, N, T, dtype, bias, pqs=T != 2)
                # chunks: past K (masked), one block each, two blocks of 8 rows
                for p in (dec_p, dict(dec_p, block_g=1), dict(dec_p, block_n=8, block_g=2)):
                    assert rel_err(_w4_run(args, p, True), ref) < 1e-2, (T, dtype, p)
                if dtype != torch.bfloat16:  # interpreter: no bf16 tl.dot (module docstring)
                    assert rel_err(_w4_run(args, mm_p, False), ref) < 1e-2, (T, dtype)

    @pytest.mark.parametrize("tactic", tw.W4A16_TACTICS, ids=[t.name for t in tw.W4A16_TACTICS])
    def test_w4a16_tactics(tactic):
        torch.manual_seed(5)
        d, m = tw._split_params(tactic)
        for T in (1, int(d["max_m"]), 5):
            args, ref = _w4_case(256, 37, T, torch.float16, True)
            assert rel_err(_w4_run(args, d if T <= d["max_m"] else m, T <= d["max_m"]), ref) < 1e-2

    PACKED = [
        t for t in tw.DECODE_TACTICS if t.as_dict().get("packed") and not t.as_dict().get("mma")
    ]

    @pytest.mark.parametrize("tactic", [PACKED[0], PACKED[-1]], ids=lambda t: t.name)
    def test_w4a16_packed_gemv(tactic):
        """The packed (bf16x2) GEMV: its arithmetic, emulated here as the PTX does it, against
        a torch model of that arithmetic (same roundings; only the fp32 additions' order
        differs; without pre_quant_scale) and within 1e-2 of the reference; rows past N, whole
        and partial last chunks, T of 1 and 3, with and without pre_quant_scale and bias."""
        torch.manual_seed(6)
        params = tactic.as_dict()
        # (K, blocks a chunk, pre_quant_scale, bias): whole chunks, a partial last one
        cases = ((256, 2, True, False), (384, 2, False, True), (384, params["block_g"], 0, 0))
        for T in (1, 3):
            for K, bg, pqs, bias in cases:
                args, ref = _w4_case(K, 37, T, torch.bfloat16, bias, pqs)
                x, qweight, scales, p, b = args
                prm = dict(params, block_g=bg)
                assert rel_err(_w4_run(args, prm, True), ref) < 1e-2, (T, K, prm)
                if pqs:  # the interpreter's bf16 cast of x * pqs truncates
                    continue
                # fp32 out: the sums before the interpreter's (truncating) bf16 cast
                out = torch.full((T, 37), float("nan"))
                tw.launch_w4a16(x, qweight, scales, p, 128, b, out, prm, True)
                model = w4a16_packed_model(x, qweight, scales, p, b)
                assert rel_err(out, model) < 1e-6, (T, K, prm)
                assert rel_err(model, ref.float()) > 1e-4  # the model is not the reference

    @pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
    def test_w4a16_dequant_gemm_expands_the_weight_then_multiplies(dtype, monkeypatch):
        """The dequantize-then-cuBLAS GEMM tactic: the expanded weight is the reference's
        dequantized one in x's dtype, bit for bit (rows past a BLOCK_N multiple, 2 blocks a
        group), and the output is x (scaled by pre_quant_scale) times it, within 1e-2 of
        the reference, with and without bias, from its min_rows rows; fewer rows take the
        first Triton GEMM tactic, decode-sized x the GEMV."""
        torch.manual_seed(8)
        K, N, gs = 512, 37, 256
        codes = torch.randint(0, 16, (N, K))
        qweight = qref.pack_w4_engine(codes)
        scales = (torch.rand(N, K // gs) * 0.02 + 0.005).to(dtype)
        w = torch.empty(N, K, dtype=dtype)
        tw._w4_dequant_kernel[(triton.cdiv(N, 16), K // 128)](
            qweight, scales, w, N, K // 128, BLOCKS_PER_GROUP=gs // 128, BLOCK_N=16
        )
        assert torch.equal(w, qref.dequantize_w4(qweight, scales, gs).to(dtype))
        expanded = []
        monkeypatch.setattr(tw, "_dequant_matmul", _Spy.calls_of(tw._dequant_matmul, expanded))
        fn = tw.make_w4a16_linear(tw.combine_tactics(tw.DECODE_TACTICS[1], tw.DEQUANT_GEMM))
        p = (torch.rand(K) + 0.5).to(dtype)
        rows = tw.DEQUANT_GEMM.as_dict()["min_rows"]
        for T, bias in ((rows, None), (rows + 3, torch.randn(N).to(dtype))):
            x = torch.randn(T, K).to(dtype)
            ref = qref.w4a16_linear(x, qweight, scales, p, gs, None, bias)
            assert rel_err(fn(x, qweight, scales, p, gs, None, bias), ref) < 1e-2, T
        assert len(expanded) == 2
        # fewer rows: the first Triton GEMM tactic; batch 1: the GEMV
        for T in (rows - 1, 1):
            x = torch.randn(T, K).to(dtype)
            ref = qref.w4a16_linear(x, qweight, scales, p, gs)
            assert rel_err(fn(x, qweight, scales, p, gs), ref) < 1e-2, T
        assert len(expanded) == 2

    @pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
    def test_w4a16_dequant_gemm_by_slabs_of_rows_equals_it_whole(dtype, monkeypatch):
        """The chunked dequantize-then-cuBLAS tactics: slabs of rows (a multiple of block_n,
        the last one short), each expanded into one reused buffer and multiplied into its
        columns of out (bias sliced with them), give the whole expansion's result; the slab
        follows chunk_bytes and K."""
        torch.manual_seed(9)
        K, N, gs = 512, 77, 128
        qweight = qref.pack_w4_engine(torch.randint(0, 16, (N, K)))
        scales = (torch.rand(N, K // gs) * 0.02 + 0.005).to(dtype)
        p, bias = (torch.rand(K) + 0.5).to(dtype), torch.randn(N).to(dtype)
        x = torch.randn(tw.DEQUANT_GEMM.as_dict()["min_rows"] + 5, K).to(dtype)
        # 32-row slabs: 32, 32 and 13 rows
        chunk = {"chunk_bytes": 32 * K * x.element_size() + 7}
        params = dict(tw.DEQUANT_GEMM.as_dict(), **chunk)
        whole = torch.empty(len(x), N, dtype=dtype)
        tw._dequant_matmul(x, qweight, scales, p, gs, bias, whole, tw.DEQUANT_GEMM.as_dict())
        kernel, slabs = tw._w4_dequant_kernel, []

        class Slabs:  # the expansion's launches: (grid, rows)
            def __getitem__(self, grid):
                return lambda *a, **kw: slabs.append((grid, a[3])) or kernel[grid](*a, **kw)

        monkeypatch.setattr(tw, "_w4_dequant_kernel", Slabs())
        out = torch.full((len(x), N), float("nan"), dtype=x.dtype)
        tw._dequant_matmul(x, qweight, scales, p, gs, bias, out, params)
        assert slabs == [((1, K // 128), 32), ((1, K // 128), 32), ((1, K // 128), 13)]
        assert not out.isnan().any()
        tol = 1e-5 if dtype == torch.float32 else 2e-3  # one rounding of a half
        torch.testing.assert_close(out, whole, rtol=tol, atol=tol)
        ref = qref.w4a16_linear(x, qweight, scales, p, gs, None, bias)
        assert rel_err(out, ref) < 1e-2

    @pytest.mark.parametrize("packed", [False, True])
    def test_w4a16_pdl_gemv_loads_its_first_chunk_before_the_wait(packed, monkeypatch):
        """The PDL variant of both GEMV kernels (the first chunk's words and scales loaded
        before the wait, x after): the plain variant's bits, with one chunk that is all of K
        (partial), whole chunks, and a partial last one; normalizing x as loaded too."""
        from fused_norm_checks import _inputs

        from ingot.plugins.gemm.fused_norm import NormIn, new_sums

        torch.manual_seed(7)
        dt = torch.bfloat16 if packed else torch.float16
        dec = next(t for t in tw.DECODE_TACTICS if bool(t.as_dict().get("packed")) == packed)
        params = dict(dec.as_dict(), block_g=2)
        spec = []
        monkeypatch.setattr(tw, "_w4a16_gemv_kernel", _Spy(tw._w4a16_gemv_kernel, spec))
        for K in (128, 256, 384):
            args, _ = _w4_case(K, 37, 1, dt, True)
            plain = _w4_run(args, params, True)
            with pdl.scope(True):
                assert torch.equal(_w4_run(args, params, True), plain), K
            x, qweight, scales, p, b = args
            sums = new_sums(1, 1, "cpu")[0]
            sums[0] = int(x.float().pow(2).sum() * 2**32)  # fine fixed-point sum of squares
            norm = NormIn(_inputs(1, 8, K, "cpu", dtype=dt)["norm_w"], 1e-5, sums)
            out = torch.empty(1, 37, dtype=dt)
            normed = tw.launch_w4a16(x, qweight, scales, p, 128, b, out.clone(), params, True,
                                     norm=norm)  # fmt: skip
            with pdl.scope(True):
                got = tw.launch_w4a16(x, qweight, scales, p, 128, b, out, params, True, norm=norm)
            assert torch.equal(got, normed), K
        assert {k["PDL"] for k in spec if "PDL" in k} and len(spec) == 12

    def test_w4a16_packed_tactics_take_other_dtypes_unpacked():
        """fp16 and fp32 activations under a packed tactic run the fp32 path (bf16x2 only)."""
        torch.manual_seed(7)
        packed = PACKED[0].as_dict()
        plain = {k: v for k, v in packed.items() if k != "packed"}
        for dtype in (torch.float16, torch.float32):
            args, ref = _w4_case(256, 37, 2, dtype, True)
            out = _w4_run(args, packed, True)
            assert torch.equal(out, _w4_run(args, plain, True)), dtype
            assert rel_err(out, ref) < 1e-2

    @pytest.mark.parametrize("packed", [False, True])
    def test_w4a16_gemv_applies_swiglu_as_it_loads(packed):
        """gated=True (the down projection): the GEMV given [gate | up] equals the GEMV given
        the SwiGLU kernel's output, bit for bit (the same fp32 math, rounded once to the
        model dtype), in both GEMV kernels, whole and partial chunks, within 1e-2 of the
        reference."""
        from ingot.plugins.activation.triton_kernels import make_swiglu

        torch.manual_seed(8)
        tactic = next(t for t in tw.DECODE_TACTICS if bool(t.as_dict().get("packed")) == packed)
        params = tactic.as_dict()
        dtypes = (torch.bfloat16,) if packed else (torch.float16, torch.float32)
        for dtype in dtypes:
            for K, bg in ((256, 2), (384, 2)):
                args, _ = _w4_case(K, 37, 2, dtype, True)
                _, qweight, scales, p, b = args
                gate_up = torch.randn(2, 2 * K).to(dtype)
                act = make_swiglu(None)(gate_up)
                prm = dict(params, block_g=bg)
                out = torch.full((2, 37), float("nan"), dtype=dtype)
                tw.launch_w4a16(gate_up, qweight, scales, p, 128, b, out, prm, True, True)
                assert torch.equal(out, _w4_run((act, qweight, scales, p, b), prm, True)), K
                ref = qref.w4a16_linear(gate_up, qweight, scales, p, 128, None, b, gated=True)
                assert rel_err(out, ref) < 1e-2

    @pytest.mark.parametrize("packed", [False, True])
    def test_w4a16_swiglu_apart_runs_the_swiglu_kernel_then_the_plain_gemv(packed, monkeypatch):
        """A `swiglu_apart` decode tactic (the down projection's extra candidates) given
        [gate | up] runs the SwiGLU kernel, then its GEMV ungated; its plain twin runs the
        GEMV gated. The same bits either way."""
        torch.manual_seed(9)
        launches = []
        monkeypatch.setattr(tw, "launch_w4a16", _Spy.calls_of(tw.launch_w4a16, launches))
        tactic = next(t for t in tw.DECODE_TACTICS if bool(t.as_dict().get("packed")) == packed
                      and not t.as_dict().get("mma") and not t.as_dict().get("persist"))  # fmt: skip
        apart = tw.swiglu_apart(tactic)
        assert apart.as_dict()["swiglu_apart"] == 1 and apart.name == tactic.name + "_sa"
        dtype = torch.bfloat16 if packed else torch.float16
        K = 384
        (_, qweight, scales, p, b), _ = _w4_case(K, 37, 1, dtype, True)
        gate_up = torch.randn(1, 2 * K).to(dtype)
        outs = []
        for t in (tactic, apart):
            launches.clear()
            fn = tw.make_w4a16_linear(tw.combine_tactics(t, tw.GEMM_TACTICS[0]))
            outs.append(fn(gate_up, qweight, scales, p, 128, None, b, gated=True))
            (a,) = launches  # one GEMV: gated, or on the SwiGLU kernel's [1, K]
            assert a[8] is True and a[9] is (t is tactic) and a[0].shape == (1, K * (1 + a[9]))
        assert torch.equal(outs[0], outs[1])
        ref = qref.w4a16_linear(gate_up, qweight, scales, p, 128, None, b, gated=True)
        assert rel_err(outs[1], ref) < 1e-2

    PERSISTENT = [t for t in tw.DECODE_TACTICS if t.as_dict().get("persist")]

    @pytest.mark.parametrize("tactic", PERSISTENT, ids=lambda t: t.name)
    def test_w4a16_persistent_gemv_is_the_plain_kernel_over_tiles(tactic, monkeypatch):
        """Resident programs (tactics with `persist`) walking tiles pid, pid + 3, ... of 7 and
        prefetching each next chunk: the plain kernel's bits with the same blocks, for bf16
        (packed loop) and fp16 (fp32 loop) x, K of 1, 2 and 3 chunks (odd and even steps per
        program) and a partial last chunk; with PDL, SwiGLU, and the folded norm and
        residual add (the same residual and sums of squares). N not a multiple of BLOCK_N
        runs the plain kernel. (All of it for the first such tactic; the others' blocks with
        and without PDL on bf16 x at 3 chunks: the interpreter is slow.)"""
        from ingot.plugins import resident
        from ingot.plugins.gemm.fused_norm import AddOut, NormIn, new_sums
        from ingot.plugins.quant import w4a16_persistent as wp

        torch.manual_seed(10)
        grid, launched = resident.resident_grid, []
        monkeypatch.setattr(resident, "resident_grid", lambda tiles, persist, dev: min(tiles, 3))
        monkeypatch.setattr(wp, "_w4a16_gemv_persistent_kernel",
                            _Spy(wp._w4a16_gemv_persistent_kernel, launched))  # fmt: skip
        params = tactic.as_dict()
        plain = {k: v for k, v in params.items() if k != "persist"}
        N = 7 * params["block_n"]
        full = tactic == PERSISTENT[0]
        for dt in (torch.bfloat16, torch.float16) if full else (torch.bfloat16,):
            for K, bg in ((128, 1), (256, 1), (384, 1), (384, 2)) if full else ((384, 1),):
                args, _ = _w4_case(K, N, 1, dt, True)
                x, qweight, scales, p, b = args
                prm, pln = dict(params, block_g=bg), dict(plain, block_g=bg)
                want = _w4_run(args, pln, True)
                assert torch.equal(_w4_run(args, prm, True), want), (dt, K, bg)
                with pdl.scope(True):
                    assert torch.equal(_w4_run(args, prm, True), want), (dt, K, bg)
                if not full:
                    continue
                gate_up = torch.randn(1, 2 * K).to(dt)
                outs = [torch.empty(1, N, dtype=dt) for _ in range(2)]
                for prm_, out in zip((prm, pln), outs, strict=True):
                    tw.launch_w4a16(gate_up, qweight, scales, p, 128, b, out, prm_, True, True)
                assert torch.equal(*outs), (dt, K, bg)
                # the norm folded in (x the residual stream); the output added into one
                sums = new_sums(2, 1, "cpu")
                sums[0, 0] = int(x.float().pow(2).sum() * 2**32)
                norm = NormIn((torch.rand(K) + 0.5).to(dt), 1e-5, sums[0])
                normed = [tw.launch_w4a16(x, qweight, scales, p, 128, b, torch.empty(1, N, dtype=dt),
                                          prm_, True, norm=norm) for prm_ in (prm, pln)]  # fmt: skip
                assert torch.equal(*normed), (dt, K, bg)
                res = [torch.randn(1, N).to(dt)] * 2
                res, got = [r.clone() for r in res], []
                for prm_, r in zip((prm, pln), res, strict=True):
                    sums[1].zero_()
                    tw.launch_w4a16(x, qweight, scales, p, 128, b, r, prm_, True,
                                    add=AddOut(r, sums[1]))  # fmt: skip
                    got.append(sums[1].clone())
                assert torch.equal(*res) and torch.equal(*got) and got[0].any(), (dt, K, bg)
        runs = 5 * 8 if full else 2
        assert len(launched) == runs and {kw.get("PDL", 0) for kw in launched} != {0}
        args, _ = _w4_case(128, N + 1, 1, torch.bfloat16, True)  # a ragged last tile
        assert torch.equal(_w4_run(args, params, True), _w4_run(args, plain, True))
        assert len(launched) == runs
        assert grid(100, params["persist"], torch.device("meta")) == params["persist"]

    MMA = [t for t in tw.DECODE_TACTICS if t.as_dict().get("mma")]

    @pytest.mark.parametrize("tactic", MMA, ids=lambda t: t.name)
    def test_w4a16_mma_gemv_from_the_fragments_layout(tactic, monkeypatch):
        """The tensor-core GEMV, its MMA emulated from the PTX fragments' layout (lane (g, q):
        A rows g and g + 8 at slots 2q, 2q + 1, 2q + 8, 2q + 9; B column g; D rows g, g + 8 at
        columns 2q, 2q + 1): without pre_quant_scale, the fp64 product of x and the
        dequantized weight within fp32 rounding (the interpreter's bf16 casts truncate
        x * pqs); with it, the reference within 1e-2. x rows 1 to 8, rows past N (a partial
        tile), K past the warps' last full pass (blocks read again at scale 0), bias, PDL (the
        same bits); SwiGLU runs before it; fp16 x takes the plain kernel; the plugin runs it
        for up to 8 rows of bf16 x."""
        from ingot.plugins.activation.triton_kernels import make_swiglu
        from ingot.plugins.quant import w4a16_mma as wm

        torch.manual_seed(11)
        launched = []
        monkeypatch.setattr(wm, "_w4a16_mma_gemv_kernel", _Spy(wm._w4a16_mma_gemv_kernel, launched))
        params = tactic.as_dict()
        for K, N, T, pqs, bias in ((256, 40, 1, False, False), (384, 32, 8, True, True),
                                   (1152, 80, 3, False, True)):  # fmt: skip
            args, ref = _w4_case(K, N, T, torch.bfloat16, bias, pqs)
            x, qweight, scales, p, b = args
            out = _w4_run(args, params, True)
            if pqs:
                assert rel_err(out, ref) < 1e-2, (K, N, T)
            else:  # fp32 out: the sums before the interpreter's bf16 cast
                sums = torch.full((T, N), float("nan"))
                tw.launch_w4a16(x, qweight, scales, p, 128, b, sums, params, True)
                exact = x.double() @ qref.dequantize_w4(qweight, scales, 128).double().t()
                exact += b.double() if bias else 0.0
                assert (sums.double() - exact).abs().max() < 1e-5 * exact.abs().max(), (K, N, T)
            with pdl.scope(True):
                assert torch.equal(_w4_run(args, params, True), out), (K, N, T)
        assert len(launched) == 8 and {kw.get("PDL", 0) for kw in launched} != {0}
        fn = tw.make_w4a16_linear(tw.combine_tactics(tactic, tw.GEMM_TACTICS[0]))
        args, _ = _w4_case(256, 32, 1, torch.bfloat16, False)
        _, qweight, scales, p, _ = args
        gate_up = torch.randn(1, 512).to(torch.bfloat16)
        gated = fn(gate_up, qweight, scales, p, 128, gated=True)
        assert torch.equal(gated, fn(make_swiglu(None)(gate_up), qweight, scales, p, 128))
        assert len(launched) == 10
        args, ref = _w4_case(256, 32, 1, torch.float16, True)
        assert rel_err(_w4_run(args, params, True), ref) < 1e-2 and len(launched) == 10
        # the plugin: up to 8 rows of bf16 x take it (past the tactic's max_m of 1), not fp16
        for T, dt, runs in (
            (5, torch.bfloat16, 11),
            (8, torch.bfloat16, 12),
            (5, torch.float16, 12),
        ):
            args, ref = _w4_case(256, 32, T, dt, False, pqs=False)
            assert rel_err(fn(*args[:4], 128), ref) < 1e-2 and len(launched) == runs, (T, dt)
        args, _ = _w4_case(256, 32, 9, torch.bfloat16, False, pqs=False)
        fn(*args[:4], 128)  # 9 rows: the GEMM
        assert len(launched) == 12  # (its bf16 tl.dot is not the interpreter's: no values)

    def test_w4a16_small_batch_half_takes_2_to_8_rows(monkeypatch):
        """A w4a16_gemm tactic with a small-batch half (combine_tactics(dec, mm, small)): one
        row runs the decode GEMV; 2 to 8 rows of bf16 x the tensor-core GEMV (SwiGLU before
        it for the down projection), where the pair alone runs the GEMM; fp16 x and 9 rows
        the GEMM."""
        from ingot.plugins.activation.triton_kernels import make_swiglu
        from ingot.plugins.quant import w4a16_mma as wm

        torch.manual_seed(12)
        launched = []
        monkeypatch.setattr(wm, "_w4a16_mma_gemv_kernel", _Spy(wm._w4a16_mma_gemv_kernel, launched))
        dec, mm = tw.DECODE_TACTICS[0], tw.GEMM_TACTICS[0]
        fn = tw.make_w4a16_linear(tw.combine_tactics(dec, mm, tw.SMALL_TACTICS[0]))
        pair = tw.make_w4a16_linear(tw.combine_tactics(dec, mm))
        for T, runs in ((1, 0), (2, 1), (8, 2)):
            args, ref = _w4_case(256, 40, T, torch.bfloat16, True, pqs=False)
            assert rel_err(fn(*args[:4], 128, None, args[4]), ref) < 1e-2, T
            assert len(launched) == runs, T
        args, ref = _w4_case(256, 40, 3, torch.bfloat16, True, pqs=False)
        pair(*args[:4], 128, None, args[4])  # the GEMM (bf16 tl.dot: no values here)
        assert len(launched) == 2
        gate_up = torch.randn(4, 512).to(torch.bfloat16)
        _, qweight, scales, pqs, _ = args
        gated = fn(gate_up, qweight, scales, pqs, 128, gated=True)
        assert len(launched) == 3
        assert torch.equal(gated, fn(make_swiglu(None)(gate_up), qweight, scales, pqs, 128))
        assert len(launched) == 4
        args, ref = _w4_case(256, 40, 5, torch.float16, True, pqs=False)
        assert rel_err(fn(*args[:4], 128, None, args[4]), ref) < 1e-2
        args, _ = _w4_case(256, 40, 9, torch.bfloat16, True, pqs=False)
        fn(*args[:4], 128, None, args[4])
        assert len(launched) == 4

    def test_w4a16_plugin_runs_the_kernels_on_cpu_tensors_in_the_interpreter():
        """Under the interpreter the plugin takes CPU tensors to its kernels (the GPU engine's
        code paths on the CPU: tests/interp_gpu_paths.py), SwiGLU included."""
        args, ref = _w4_case(128, 40, 2, torch.float32, True)
        x, qweight, scales, p, b = args
        seen = []
        real = tw.launch_w4a16
        tw.launch_w4a16 = lambda *a: seen.append(a[8:10]) or real(*a)  # (decode, gated)
        try:
            out = tw.make_w4a16_linear(None)(x, qweight, scales, p, 128, None, b)
            gated = tw.make_w4a16_linear(None)(torch.cat([x, x], 1), qweight, scales, p, 128,
                                               None, b, gated=True)  # fmt: skip
        finally:
            tw.launch_w4a16 = real
        assert seen == [(False, False), (False, False)]  # T = 2 > max_m: SwiGLU, then the GEMM
        assert rel_err(out, ref) < 1e-2
        assert rel_err(gated, qref.w4a16_linear(torch.cat([x, x], 1), qweight, scales, p, 128,
                                                None, b, gated=True)) < 1e-2  # fmt: skip

    # ------------------------------------------------------------------ FP8 KV cache

    HQ, HKV, HD, BS, NB = 4, 2, 32, 16, 16

    # the KV caches a test runs on: plain (the model dtype), FP8 with V in the layout FP8 pools
    # use (transposed per block), FP8 with V token-major like K (still supported)
    KV_KINDS = ["plain", "fp8", "fp8_v_rows"]

    def _kv_batch(lens_new: list[int], ctx: list[int], dtype, kind: str, bs: int = BS):
        """Caches filled through the reference write_kv (fp8 with scales, or plain)."""
        fp8 = kind != "plain"
        B = len(ctx)
        perm = torch.randperm(NB)
        width = -(-max(ctx) // bs)
        assert B * width <= NB
        bt = perm[: B * width].reshape(B, width).int()
        cache_dtype = F8 if fp8 else dtype
        kc = torch.zeros(NB, bs, HKV, HD, dtype=cache_dtype)
        vc = v_like(kc, transposed=kind == "fp8")
        assert is_transposed(vc) == (kind == "fp8")
        k_scale, v_scale = torch.tensor(2.5 / 448), torch.tensor(1.7 / 448)
        scales = {"k_scale": k_scale, "v_scale": v_scale} if fp8 else {}
        for b in range(B):
            t = torch.arange(ctx[b])
            slots = (bt[b, t // bs].long() * bs + t % bs).int()
            k, v = torch.randn(ctx[b], HKV, HD).to(dtype), torch.randn(ctx[b], HKV, HD).to(dtype)
            attn_ref.write_kv(k, v, kc, vc, slots, **scales)
        qsl = torch.tensor([0, *torch.tensor(lens_new).cumsum(0).tolist()]).int()
        q = torch.randn(int(qsl[-1]), HQ, HD).to(dtype)
        return q, kc, vc, bt, torch.tensor(ctx).int(), qsl, scales

    @pytest.mark.parametrize("kind", KV_KINDS)
    def test_kv_write(kind):
        torch.manual_seed(6)
        T = 9
        k, v = torch.randn(T, HKV, HD) * 2, torch.randn(T, HKV, HD)
        slots = torch.randperm(NB * BS)[:T].int()
        slots[3] = -1  # a padding token: skipped
        fp8 = kind != "plain"
        dt = F8 if fp8 else torch.float32
        scales = {"k_scale": torch.tensor(0.01), "v_scale": torch.tensor(0.003)} if fp8 else {}
        kc = torch.zeros(NB, BS, HKV, HD, dtype=dt)
        vc, vc_r = (v_like(kc, transposed=kind == "fp8") for _ in range(2))
        kc_r = kc.clone()
        keep = slots >= 0
        attn_ref.write_kv(k[keep], v[keep], kc_r, vc_r, slots[keep], **scales)
        for tactic in kvw.KV_WRITE_TACTICS:
            kvw.make_write_kv(tactic)(k, v, kc, vc, slots, **scales)
            if fp8:
                assert same_bits(kc, kc_r) and same_bits(vc, vc_r)
            else:
                assert torch.equal(kc, kc_r) and torch.equal(vc, vc_r)

    @pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
    def test_rope_write_kv_fp8(dtype):
        """RoPE fused with the FP8 KV write stores the bits of RoPE then the FP8 KV write, and
        the reference's values (to fp8 rounding)."""
        torch.manual_seed(12)
        T = 64  # enough values that skipping k's rounding to its dtype shows in the fp8 bits
        q, k, v = (torch.randn(T, h, HD).to(dtype) for h in (HQ, HKV, HKV))
        pos = torch.randint(0, 64, (T,)).int()
        theta = torch.rand(64, HD // 2) * 6
        cos, sin = torch.cat([theta.cos()] * 2, -1), torch.cat([theta.sin()] * 2, -1)
        slots = torch.randperm(NB * BS)[:T].int()
        slots[4] = -1  # a padding token: skipped
        scales = {"k_scale": torch.tensor(0.01), "v_scale": torch.tensor(0.004)}
        fused_q, kc, vc = rope_fp8_write_fused_vs_unfused(
            q, k, v, pos, cos, sin, slots, scales, (NB, BS, HKV, HD)
        )
        keep = slots >= 0
        assert is_transposed(vc)
        kc_r, vc_r = torch.zeros_like(kc), torch.zeros(vc.shape, dtype=vc.dtype)
        ref_q = rope_ref.rope_write_kv(
            q[keep], k[keep], v[keep], pos[keep], cos, sin, kc_r, vc_r, slots[keep], **scales
        )
        assert rel_err(fused_q[keep], ref_q) < 1e-2
        for got, ref, sc in ((kc, kc_r, 0.01), (vc, vc_r, 0.004)):
            assert rel_err(got.float() * sc, ref.float() * sc) < 5e-2

    @pytest.mark.parametrize("kind", KV_KINDS)
    @pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
    @pytest.mark.parametrize(
        "tactic",
        # the last: each tile's block-table entry read a tile ahead (bt_ahead)
        [dec.DECODE_TACTICS[0], dec.DECODE_TACTICS[3], dec.DECODE_TACTICS[-2],
         next(t for t in dec.DECODE_TACTICS if "bt_ahead" in t.as_dict())],
        ids=lambda t: t.name,
    )  # fmt: skip
    @pytest.mark.parametrize("bs", [BS, 64])  # key tiles across blocks; inside one block
    def test_decode_attention(kind, dtype, tactic, bs):
        torch.manual_seed(7)
        ctx = [5, 70, 33]
        fp8 = kind != "plain"
        q, kc, vc, bt, cl, qsl, scales = _kv_batch([1, 1, 1], ctx, dtype, kind, bs)
        ref = attn_ref.paged_attention(q, kc, vc, bt, cl, qsl, HD**-0.5, **scales)
        out = torch.full_like(q, float("nan"))
        dec.make_decode_attention(tactic)(q, kc, vc, bt, cl, qsl, HD**-0.5, out=out, **scales)
        tol = 5e-2 if fp8 or dtype != torch.float32 else 1e-5
        assert rel_err(out, ref) < tol

    @pytest.mark.parametrize("kind", KV_KINDS[:2])
    @pytest.mark.parametrize("target", [1, 12, 1024])
    @pytest.mark.parametrize("window", [None, 20])
    def test_decode_split_plans(kind, target, window, monkeypatch):
        """Fewer splits as the batch grows (one split: no partials, no reduce); each sequence
        spreads its own context (the window's part of it) over the splits, however short."""
        monkeypatch.setattr(dec, "_TARGET_PROGRAMS", target)
        torch.manual_seed(9)
        ctx = [5, 70, 33]
        fp8 = kind != "plain"
        q, kc, vc, bt, cl, qsl, scales = _kv_batch([1, 1, 1], ctx, torch.float32, kind)
        ref = attn_ref.paged_attention(q, kc, vc, bt, cl, qsl, HD**-0.5, window, **scales)
        tactic = dec.DECODE_TACTICS[3]  # partition 64, block_n 32
        assert dec.split_plan(3 * HKV, 256, 64) == {1: 1, 12: 2, 1024: 4}[target]
        out = torch.full_like(q, float("nan"))
        fn = dec.make_decode_attention(tactic)
        fn(q, kc, vc, bt, cl, qsl, HD**-0.5, window, out=out, max_context_len=256, **scales)
        assert rel_err(out, ref) < (5e-2 if fp8 else 1e-5)

    @pytest.mark.parametrize("kind", KV_KINDS[:2])
    def test_decode_split_min_gives_short_contexts_fewer_splits(kind):
        """split_min (the large-batch tactics'): no split of a sequence shorter than it, so a
        short context takes fewer of the grid's splits (one: written directly, no merge) and a
        long one still spreads; the grid's splits are bounded by it too."""
        torch.manual_seed(13)
        ctx = [5, 70, 33, 200]  # one split, two of 64 keys, one, four of 64
        q, kc, vc, bt, cl, qsl, scales = _kv_batch([1] * 4, ctx, torch.float32, kind, 64)
        ref = attn_ref.paged_attention(q, kc, vc, bt, cl, qsl, HD**-0.5, **scales)
        params = (("partition", 32), ("block_n", 32), ("num_warps", 4), ("num_stages", 2))
        tactic = Tactic("m64", (*params, ("programs", 1024), ("split_min", 50)))
        assert dec.split_plan(4 * HKV, 256, 64, 1024) == 4  # split_min 50 -> 64 keys
        out = torch.full_like(q, float("nan"))
        fn = dec.make_decode_attention(tactic)
        fn(q, kc, vc, bt, cl, qsl, HD**-0.5, out=out, max_context_len=256, **scales)
        assert rel_err(out, ref) < (5e-2 if kind != "plain" else 1e-5)
        assert not dec._COUNTERS[q.device].any()

    @pytest.mark.parametrize("kind", KV_KINDS[:2])
    def test_decode_splits_merge_in_the_last_program(kind, monkeypatch):
        """With several splits holding keys, the program that counts itself done last merges
        the partials (two splits per merge step here, so the merge loops); a sequence whose
        keys fit one split is written by it directly. The done-counters are left zeroed, so
        the next launch (a graph replay) gives the same output."""
        monkeypatch.setattr(dec, "merge_splits", lambda g, d_pad, warps: 2)
        torch.manual_seed(11)
        ctx = [100, 7]  # four splits of 32 keys; one split
        q, kc, vc, bt, cl, qsl, scales = _kv_batch([1, 1], ctx, torch.float32, kind)
        ref = attn_ref.paged_attention(q, kc, vc, bt, cl, qsl, HD**-0.5, **scales)
        fn = dec.make_decode_attention(dec.DECODE_TACTICS[3])  # partition 64, block_n 32
        assert dec.split_plan(2 * HKV, 256, 64) == 4
        outs = []
        for _ in range(2):
            out = torch.full_like(q, float("nan"))
            fn(q, kc, vc, bt, cl, qsl, HD**-0.5, out=out, max_context_len=256, **scales)
            assert not dec._COUNTERS[q.device].any()
            outs.append(out)
        assert rel_err(outs[0], ref) < (5e-2 if kind != "plain" else 1e-5)
        assert torch.equal(outs[1], outs[0])

    @pytest.mark.parametrize("kind", KV_KINDS[:2])
    def test_mixed_step_decodes_run_the_decode_kernel(kind, monkeypatch):
        """A mixed step: prompts (chunks) first, then one-query decodes. With num_decodes the
        decodes run the decode kernel (from sequence seq0 of the batch's tables), the rest the
        prefill kernel; the result is the reference's either way."""
        torch.manual_seed(10)
        new, ctx = [20, 7, 1, 1, 1], [20, 30, 45, 9, 60]
        q, kc, vc, bt, cl, qsl, scales = _kv_batch(new, ctx, torch.float16, kind, bs=32)
        ref = attn_ref.paged_attention(q, kc, vc, bt, cl, qsl, HD**-0.5, **scales)
        calls = []
        launch = dec.launch_decode

        def spy(q_rows, *args, seq0=0, **kw):
            calls.append((q_rows.shape[0], seq0))
            return launch(q_rows, *args, seq0=seq0, **kw)

        monkeypatch.setattr(dec, "launch_decode", spy)
        fn = dec.make_paged_attention(None)
        out = torch.full_like(q, float("nan"))
        fn(q, kc, vc, bt, cl, qsl, HD**-0.5, max_query_len=20, out=out, num_decodes=3, **scales)
        assert calls == [(3, 2)]
        assert rel_err(out, ref) < 5e-2
        calls.clear()  # without the count every row goes through the prefill kernel
        out2 = fn(q, kc, vc, bt, cl, qsl, HD**-0.5, max_query_len=20, **scales)
        assert calls == [] and rel_err(out2, ref) < 5e-2

    @pytest.mark.parametrize("kind", KV_KINDS[:2])
    @pytest.mark.parametrize("quant_out", [False, True])
    def test_graph_step_takes_one_query_sequences_anywhere_to_the_decode_kernel(
        kind, quant_out, monkeypatch
    ):
        """ANY_DECODES (a captured graph of a step with prompts, which cannot know its
        decodes): one-query sequences anywhere in the step (decodes before, between and after
        prompts, a padding sequence of one token last; empty sequences between) run the
        decode kernel at their rows, split in two (merged) or not; the prefill kernel leaves
        them alone. Every row equals the reference's, and no row is written twice."""
        monkeypatch.setitem(globals(), "NB", 64)
        torch.manual_seed(16)
        new, ctx = [1, 9, 0, 1, 3, 1], [70, 9, 1, 40, 20, 1]
        q, kc, vc, bt, cl, qsl, scales = _kv_batch(new, ctx, torch.float16, kind)
        fn = dec.make_paged_attention(dec.combine_tactics(dec.DECODE_TACTICS[3], SMALL_TILES[1]))
        calls = []
        launch_dec, launch_pf = dec.launch_decode, dec.launch_prefill

        def spy_dec(*args, qsl=None, **kw):
            calls.append(("decode", qsl is not None))
            return launch_dec(*args, qsl=qsl, **kw)

        def spy_pf(*args, skip_single=False, **kw):
            calls.append(("prefill", skip_single))
            return launch_pf(*args, skip_single=skip_single, **kw)

        monkeypatch.setattr(dec, "launch_decode", spy_dec)
        monkeypatch.setattr(dec, "launch_prefill", spy_pf)
        ref = attn_ref.paged_attention(q, kc, vc, bt, cl, qsl, HD**-0.5, **scales)
        kw = dict(max_query_len=16, num_decodes=attn_ref.ANY_DECODES, **scales)
        if quant_out:
            kw["out_scale"] = ref.float().abs().max() / 448
            ref = qref.quantize_fp8(ref, kw["out_scale"])
        out = torch.full_like(ref, float("nan"))
        fn(q, kc, vc, bt, cl, qsl, HD**-0.5, out=out, **kw)
        assert calls == [("prefill", True), ("decode", True)]
        scale = kw["out_scale"] if quant_out else 1.0
        assert not out.float().isnan().any()
        for b in range(len(new)):  # each sequence's rows, one at a time
            rows = slice(int(qsl[b]), int(qsl[b + 1]))
            got, want = out[rows].float() * scale, ref[rows].float() * scale
            assert rel_err(got, want) < 5e-2, (b, new[b])
        # each kernel alone leaves the other's rows untouched (still NaN)
        for skip in (True, False):
            out = torch.full_like(ref, float("nan"))
            if skip:
                dec.launch_prefill(q, kc, vc, bt, cl, qsl, HD**-0.5, 0, 16, out,
                                   SMALL_TILES[1].as_dict(), out_scale=kw.get("out_scale"),
                                   skip_single=True, **scales)  # fmt: skip
            else:
                dec.launch_decode(q, kc, vc, bt, cl, HD**-0.5, 0, 80, out,
                                  dec.DECODE_TACTICS[3].as_dict(), out_scale=kw.get("out_scale"),
                                  qsl=qsl, **scales)  # fmt: skip
            written = ~out.float().isnan().flatten(1).all(1)
            single = torch.tensor([n == 1 for n in new for _ in range(n)])
            assert torch.equal(written, ~single if skip else single), (skip, written)

    @pytest.mark.parametrize("kind", KV_KINDS[:2])
    @pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
    def test_attention_output_quantized_for_the_fp8_o_projection(kind, dtype, monkeypatch):
        """out_scale: the kernels store the bits the quantize kernel gives from their output in
        the model dtype: decode with several splits (merged in the last program) and with one,
        prefill, and a mixed step's trailing decodes; the reference quantizes its own output."""
        monkeypatch.setattr(dec, "merge_splits", lambda g, d_pad, warps: 2)
        torch.manual_seed(13)
        fn = dec.make_paged_attention(dec.combine_tactics(dec.DECODE_TACTICS[3], SMALL_TILES[1]))
        cases = (
            ([1, 1], [100, 7], 1, 0, 256),  # decode: four splits for the 100-key sequence
            ([1, 1], [100, 7], 1, 0, 32),  # decode, one split
            ([7, 20, 1, 1], [7, 60, 40, 9], 20, 2, None),  # prefill rows, then two decodes
        )
        for new, ctx, max_q, nd, max_ctx in cases:
            q, kc, vc, bt, cl, qsl, scales = _kv_batch(new, ctx, dtype, kind)
            kw = dict(max_query_len=max_q, max_context_len=max_ctx, num_decodes=nd, **scales)
            plain = fn(q, kc, vc, bt, cl, qsl, HD**-0.5, **kw)
            os = plain.float().abs().max() / 448  # as calibration would set it
            fused = fn(q, kc, vc, bt, cl, qsl, HD**-0.5, out_scale=os, **kw)
            assert fused.dtype == F8 and same_bits(fused, tq.quantize_fp8(plain, os)), new
            ref = attn_ref.paged_attention(q, kc, vc, bt, cl, qsl, HD**-0.5, **scales)
            ref_q = attn_ref.paged_attention(
                q, kc, vc, bt, cl, qsl, HD**-0.5, out_scale=os, **scales
            )
            assert same_bits(ref_q, qref.quantize_fp8(ref, os))
            assert rel_err(fused.float() * os, ref.float()) < 5e-2, new

    @pytest.mark.parametrize("kind", KV_KINDS)
    @pytest.mark.parametrize("bs", [BS, 32])  # 16-token segments; whole 32-byte sectors
    def test_decode_rows_v_stored_by_the_attention_kernel(kind, bs):
        """new_v: the decode kernel stores each decode row's V (the segment of its block
        around it, stored whole) and attends to it, whether the context splits (the last split
        stores it), fits one split, or the decodes trail a mixed step's prefill rows; newest
        keys at a block's first and last slot."""
        torch.manual_seed(14)
        fn = dec.make_paged_attention(dec.combine_tactics(dec.DECODE_TACTICS[3], SMALL_TILES[1]))
        cases = (
            ([1, 1, 1], [70, 32, 17], 1, 0, 256),  # decode: splits
            ([1, 1, 1], [70, 32, 17], 1, 0, 32),  # decode, one split
            ([7, 20, 1, 1], [7, 60, 40, 17], 20, 2, None),  # prefill rows, then two decodes
        )
        for new, ctx, max_q, nd, max_ctx in cases:
            q, kc, vc, bt, cl, qsl, scales = _kv_batch(new, ctx, torch.float16, kind, bs)
            kw = dict(max_query_len=max_q, max_context_len=max_ctx, num_decodes=nd, **scales)
            new_v_stored_by_attention(fn, q, kc, vc, bt, cl, qsl, HD**-0.5, kw)

    def test_rope_write_kv_leaves_the_decode_rows_v():
        """v_rows: K of every token, V of the first v_rows only, in the Triton kernel and the
        reference alike (each against itself writing every V)."""
        torch.manual_seed(15)
        T, t = 12, 9
        q, k, v = (torch.randn(T, h, HD).to(torch.float16) for h in (HQ, HKV, HKV))
        pos = torch.randint(0, 64, (T,)).int()
        theta = torch.rand(64, HD // 2) * 6
        cos, sin = torch.cat([theta.cos()] * 2, -1), torch.cat([theta.sin()] * 2, -1)
        slots = torch.randperm(NB * BS)[:T].int()
        blk, off = slots.long() // BS, slots.long() % BS
        scales = {"k_scale": torch.tensor(0.01), "v_scale": torch.tensor(0.004)}
        for impl in (rope_gpu.make_rope_write_kv(None), rope_ref.rope_write_kv):
            kc = torch.zeros(NB, BS, HKV, HD, dtype=F8)
            (k1, v1), (k2, v2) = (kc, v_like(kc)), (kc.clone(), v_like(kc))
            impl(q, k, v, pos, cos, sin, k1, v1, slots, v_rows=t, **scales)
            impl(q, k, v, pos, cos, sin, k2, v2, slots, **scales)
            assert same_bits(k1, k2)
            v_at, v_all = (c[blk, off].view(torch.uint8).flatten(1) for c in (v1, v2))
            assert torch.equal(v_at[:t], v_all[:t]) and v_all.any(-1).all()
            assert not v_at[t:].any()

    # m16_n64: several query tiles per sequence; m16_n16: key tiles below the diagonal too;
    # gqa: the two q heads of a kv head packed into one tile (8 queries each)
    SMALL_TILES = [
        next(t for t in pf.PREFILL_TACTICS if t.name == "m16_n64_w4_s2"),
        Tactic("m16_n16", (("block_m", 16), ("block_n", 16), ("num_warps", 4), ("num_stages", 1))),
        Tactic(
            "m16_n16_gqa",
            (("block_m", 16), ("block_n", 16), ("num_warps", 4), ("num_stages", 1), ("gqa", 1)),
        ),
    ]

    @pytest.mark.parametrize("kind", KV_KINDS[1:])
    @pytest.mark.parametrize("params", [*SMALL_TILES, pf.PREFILL_TACTICS[0]], ids=lambda t: t.name)
    def test_prefill_attention_with_fp8_queries(kind, params):
        """fp8_queries: each query row the prefill kernel attends rounded to FP8 with its own
        scale and Q.K run on the FP8 operands (K straight from the cache): the reference on the
        rounded queries (fp8_query_rows), closer to it than the unrounded queries are; the
        rounding keeps an all-zero row."""
        torch.manual_seed(18)
        new, ctx = [7, 1, 20], [7, 30, 60]
        q, kc, vc, bt, cl, qsl, scales = _kv_batch(new, ctx, torch.float16, kind)
        q = q * torch.logspace(-2, 2, q.shape[0])[:, None, None].half()  # rows of all sizes
        q[3, 1] = 0.0
        fn = pf.make_prefill_attention(params)
        out = fn(q, kc, vc, bt, cl, qsl, HD**-0.5, fp8_queries=True, **scales)
        rows = attn_ref.fp8_query_rows(q)
        ref = attn_ref.paged_attention(rows, kc, vc, bt, cl, qsl, HD**-0.5, **scales)
        plain = attn_ref.paged_attention(q, kc, vc, bt, cl, qsl, HD**-0.5, **scales)
        # (measured: 6.6e-4 against 6.6e-2: the rounding moves the output 100 times more than
        # the kernel's summation order does)
        assert rel_err(out, ref) < 5e-3 < rel_err(out, plain)
        assert torch.equal(rows[3, 1], q[3, 1]) and not torch.equal(rows, q)

    @pytest.mark.parametrize("block_n", [16, 32])
    @pytest.mark.parametrize("peaked", [False, True])
    def test_decode_fp8mma_experiment_precision(block_n, peaked):
        """triton_decode_fp8mma (EXPERIMENT: both dots on FP8 tensor cores, swapped so that a
        GQA group is wgmma's N), flat and peaked attention; contexts of one key, of part of a
        tile, of several blocks. Queries and P rounded once: near the reference on rounded
        queries (P's rounding the rest). In two terms each (the default): near the reference
        itself, ten times nearer than rounded once."""
        from ingot.plugins.attention import triton_decode_fp8mma as f8mma

        torch.manual_seed(23)
        ctx = [37, 60, 1, 20]
        q, kc, vc, bt, cl, qsl, sc = _kv_batch([1] * len(ctx), ctx, torch.float16, "fp8")
        q = q * (4 if peaked else 0.25)
        ref = attn_ref.paged_attention(q, kc, vc, bt, cl, qsl, HD**-0.5, **sc)
        rounded = attn_ref.paged_attention(attn_ref.fp8_query_rows(q), kc, vc, bt, cl, qsl,
                                           HD**-0.5, **sc)  # fmt: skip
        args = (q, kc, vc, bt, cl, HD**-0.5, sc["k_scale"], sc["v_scale"])
        once = f8mma.decode_fp8mma(*args, block_n=block_n, two_term=False)
        two = f8mma.decode_fp8mma(*args, block_n=block_n)
        assert two.dtype == q.dtype and torch.isfinite(two).all()
        # measured (flat / peaked): once 6.6e-3 / 2.8e-2 from the reference (6.5e-3 / 3.0e-3
        # from rounded queries'); two terms 1.9e-4 / 6.5e-4
        assert rel_err(once, rounded) < 1e-2
        assert rel_err(two, ref) < min(1e-3, 0.1 * rel_err(once, ref))

    def test_paged_attention_fp8mma_experiment_takes_large_decode_launches_only(monkeypatch):
        """INGOT_FP8MMA_DECODE (an A/B switch): paged_attention's decode launches of at least
        LARGE_BATCH_ROWS rows (lowered here) run triton_decode_fp8mma, the same bits as it
        alone (the FP8 output too); a decode-only step, a mixed step's trailing decodes;
        not with a window, not below the rows, not without the variable."""
        from ingot.plugins.attention import triton_decode_fp8mma as f8mma

        torch.manual_seed(29)
        monkeypatch.setattr(dec, "LARGE_BATCH_ROWS", 6)
        fn = dec.make_paged_attention(None)
        ctx = [9, 40, 17, 3]
        q, kc, vc, bt, cl, qsl, sc = _kv_batch([1] * 4, ctx, torch.float16, "fp8")
        os_ = torch.tensor(0.02)
        alone = f8mma.decode_fp8mma(q, kc, vc, bt, cl, HD**-0.5, sc["k_scale"], sc["v_scale"])
        alone_q = f8mma.decode_fp8mma(q, kc, vc, bt, cl, HD**-0.5, sc["k_scale"],
                                      sc["v_scale"], out_scale=os_)  # fmt: skip
        plain = fn(q, kc, vc, bt, cl, qsl, HD**-0.5, max_query_len=1, **sc)
        monkeypatch.setenv(dec.FP8MMA_ENV, "1")
        out = fn(q, kc, vc, bt, cl, qsl, HD**-0.5, max_query_len=1, **sc)  # 4 x 2 rows >= 6
        assert torch.equal(out, alone) and not torch.equal(out, plain)
        out_q = fn(q, kc, vc, bt, cl, qsl, HD**-0.5, max_query_len=1, out_scale=os_, **sc)
        assert same_bits(out_q, alone_q) and same_bits(alone_q, qref.quantize_fp8(alone, os_))
        windowed = fn(q, kc, vc, bt, cl, qsl, HD**-0.5, 5, max_query_len=1, **sc)
        assert torch.equal(windowed, dec.make_paged_attention(None)(
            q, kc, vc, bt, cl, qsl, HD**-0.5, 5, max_query_len=1, **sc))  # fmt: skip
        # a mixed step: a 5-token chunk, then 3 decodes (6 rows) and then 2 (4 rows, too few)
        for nd in (3, 2):
            new = [5] + [1] * nd
            qm, kcm, vcm, btm, clm, qslm, scm = _kv_batch(new, [30] + ctx[:nd], torch.float16,
                                                           "fp8")  # fmt: skip
            kw = dict(max_query_len=5, num_decodes=nd, **scm)
            mixed = fn(qm, kcm, vcm, btm, clm, qslm, HD**-0.5, **kw)
            dec_rows = f8mma.decode_fp8mma(qm[5:], kcm, vcm, btm[1:], clm[1:], HD**-0.5,
                                           scm["k_scale"], scm["v_scale"])  # fmt: skip
            assert torch.equal(mixed[5:], dec_rows) == (nd == 3), nd
            monkeypatch.delenv(dec.FP8MMA_ENV)
            assert torch.equal(fn(qm, kcm, vcm, btm, clm, qslm, HD**-0.5, **kw)[:5], mixed[:5])
            monkeypatch.setenv(dec.FP8MMA_ENV, "1")

    @pytest.mark.parametrize("kind", KV_KINDS[1:])
    def test_paged_attention_fp8_queries_experiment_rounds_prefill_rows_only(kind, monkeypatch):
        """INGOT_FP8_QUERIES=1 (an A/B switch): paged_attention's prefill kernel runs with
        fp8_queries over the sequences it takes, the routes unchanged: the reference's
        fp8_queries, which rounds the queries of prefill_seqs only (a one-token chunk mid-step
        too; not the trailing decode rows; with ANY_DECODES, not any one-query sequence);
        decode-only steps are untouched, and without the variable nothing changes."""
        torch.manual_seed(19)
        fn = dec.make_paged_attention(None)
        cases = (
            ([7, 1, 20], [7, 30, 60], 0, []),
            ([7, 20, 1, 1], [7, 60, 40, 9], 2, [2, 3]),
            ([7, 1, 20, 1], [7, 30, 60, 9], attn_ref.ANY_DECODES, [1, 3]),
        )
        for new, ctx, nd, decodes in cases:
            q, kc, vc, bt, cl, qsl, sc = _kv_batch(new, ctx, torch.float16, kind)
            q = q * 4
            kw = dict(max_query_len=max(new), num_decodes=nd, **sc)
            ref = attn_ref.paged_attention(q, kc, vc, bt, cl, qsl, HD**-0.5, fp8_queries=True,
                                           **kw)  # fmt: skip
            plain = attn_ref.paged_attention(q, kc, vc, bt, cl, qsl, HD**-0.5, **sc)
            monkeypatch.setenv(dec.FP8_QUERIES_ENV, "1")
            out = fn(q, kc, vc, bt, cl, qsl, HD**-0.5, **kw)
            assert rel_err(out, ref) < 5e-3 < rel_err(out, plain), new
            for b in range(len(new)):
                rows = slice(int(qsl[b]), int(qsl[b + 1]))
                if b in decodes:  # the decode kernel's: not rounded
                    assert rel_err(out[rows], plain[rows]) < 5e-3, (new, b)
                else:
                    assert rel_err(out[rows], plain[rows]) > 5e-3 > rel_err(out[rows], ref[rows])
            monkeypatch.delenv(dec.FP8_QUERIES_ENV)
            assert rel_err(fn(q, kc, vc, bt, cl, qsl, HD**-0.5, **kw), plain) < 5e-3
        q, kc, vc, bt, cl, qsl, sc = _kv_batch([1, 1], [9, 40], torch.float16, kind)
        monkeypatch.setenv(dec.FP8_QUERIES_ENV, "1")
        out = fn(q, kc, vc, bt, cl, qsl, HD**-0.5, max_query_len=1, **sc)
        plain = attn_ref.paged_attention(q, kc, vc, bt, cl, qsl, HD**-0.5, **sc)
        assert rel_err(out, plain) < 5e-3

    @pytest.mark.parametrize("kind", KV_KINDS)
    @pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
    # and the short-prompt candidates (GQA-packed, narrow query tiles)
    @pytest.mark.parametrize("params", [*SMALL_TILES, *pf.SHORT_PROMPT_TACTICS],
                             ids=lambda t: t.name)  # fmt: skip
    def test_prefill_attention(kind, dtype, params):
        torch.manual_seed(8)
        new, ctx = [7, 1, 20], [7, 30, 60]  # a prompt, a decode row, a chunk after a prefix
        fp8 = kind != "plain"
        q, kc, vc, bt, cl, qsl, scales = _kv_batch(new, ctx, dtype, kind)
        ref = attn_ref.paged_attention(q, kc, vc, bt, cl, qsl, HD**-0.5, **scales)
        out = torch.full_like(q, float("nan"))
        pf.make_prefill_attention(params)(q, kc, vc, bt, cl, qsl, HD**-0.5, out=out, **scales)
        tol = 5e-2 if fp8 or dtype != torch.float32 else 1e-5
        assert rel_err(out, ref) < tol
        # a sliding window (keys past it in whole tiles below the diagonal)
        ref_w = attn_ref.paged_attention(q, kc, vc, bt, cl, qsl, HD**-0.5, 9, **scales)
        out_w = pf.make_prefill_attention(params)(q, kc, vc, bt, cl, qsl, HD**-0.5, 9, **scales)
        assert rel_err(out_w, ref_w) < tol
        # the paged_attention entry point: prefill and (one query per sequence) decode
        fn = dec.make_paged_attention(None)
        out2 = fn(q, kc, vc, bt, cl, qsl, HD**-0.5, max_query_len=max(new), **scales)
        assert rel_err(out2, ref) < tol

    @pytest.mark.parametrize("kind", KV_KINDS)
    # key tiles of 16 in blocks of 16 and 32 (a tile a block, two a block); of 32 and 64 over
    # blocks of 16 (a tile spans two, four blocks)
    @pytest.mark.parametrize("block_n,bs", [(16, BS), (16, 32), (32, BS), (64, BS)])
    @pytest.mark.parametrize("window", [0, 9])
    def test_prefill_attention_read_ahead_gives_the_same_bits(kind, block_n, bs, window):
        """bt_ahead: each key tile's block-table entries read a tile ahead and carried through
        both loops (below the diagonal, then on it); same addresses, so the same bits as the
        kernel reading them in the tile's own iteration, across blocks and with a window."""
        torch.manual_seed(10)
        new, ctx = [7, 1, 20, 41], [7, 30, 60, 62]
        q, kc, vc, bt, cl, qsl, scales = _kv_batch(new, ctx, torch.float16, kind, bs)
        plain = Tactic(
            f"m16_n{block_n}",
            (("block_m", 16), ("block_n", block_n), ("num_warps", 4), ("num_stages", 1)),
        )
        ahead = pf.read_ahead(plain)
        ref = attn_ref.paged_attention(q, kc, vc, bt, cl, qsl, HD**-0.5, window or None, **scales)
        outs = [
            pf.make_prefill_attention(t)(q, kc, vc, bt, cl, qsl, HD**-0.5, window, **scales)
            for t in (plain, ahead)
        ]
        assert torch.equal(outs[0].view(torch.int16), outs[1].view(torch.int16))
        assert rel_err(outs[1], ref) < 5e-2
