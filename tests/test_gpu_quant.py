"""Quantized GPU kernels against their references at Llama-3-8B shapes (H200 run).

FP8 GEMM (Triton quantize + cuBLASLt), W4A16 GEMM (Triton, decode and gemm paths), the FP8
quantize kernels (bit-exact) and the FP8 KV cache (write bit-exact; decode and prefill attention).
Outputs are poisoned with NaN first; every tactic is exercised. Skipped without CUDA.
"""

from __future__ import annotations

import pytest
import torch
from kernel_checks import (
    fp8_hard_values,
    new_v_stored_by_attention,
    rel_err,
    rope_fp8_write_fused_vs_unfused,
    same_bits,
    w4a16_packed_model,
)

from ingot.plugins.attention import reference as attn_ref
from ingot.plugins.attention import triton_decode as dec
from ingot.plugins.attention import triton_kv_write as kvw
from ingot.plugins.attention import triton_prefill as pf
from ingot.plugins.attention.layout import is_transposed, v_like
from ingot.plugins.quant import cuda_fp8
from ingot.plugins.quant import reference as qref
from ingot.plugins.quant import triton_quantize as tq
from ingot.plugins.quant import triton_w4a16 as tw

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

DEV = "cuda"
BF16 = torch.bfloat16
F8 = torch.float8_e4m3fn
FP8_TOL = 5e-2
W4_TOL = 1e-2
# Llama-3-8B linears (N, K): qkv, o, gate_up, down
SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]
TS = [1, 2, 4, 7, 64, 300]
# the 2,048-token candidates and the short-prompt ones (a tactic's `prompts:` part)
ALL_PREFILL = pf.PREFILL_TACTICS + pf.SHORT_PROMPT_TACTICS


def ids(tactics):
    return [t.name for t in tactics]


def sm() -> int:
    major, minor = torch.cuda.get_device_capability()
    return major * 10 + minor


needs_fp8 = pytest.mark.skipif(
    not torch.cuda.is_available() or sm() < 89, reason="FP8 needs SM >= 89"
)


# --------------------------------------------------------------------------- FP8


@needs_fp8
@pytest.mark.parametrize("dtype", [BF16, torch.float16, torch.float32])
def test_quantize_fp8_bit_exact(dtype):
    x = torch.cat([torch.randn(1000, 4096) * 50, torch.randn(8, 4096) * 1e-3]).to(DEV, dtype)
    s = torch.tensor(0.37, device=DEV)
    ref = qref.quantize_fp8(x, s)
    for tactic in tq.QUANTIZE_TACTICS:
        out = torch.zeros_like(x, dtype=F8)
        assert same_bits(tq.quantize_fp8(x, s, out=out, tactic=tactic), ref), tactic.name


@needs_fp8
@pytest.mark.parametrize("dtype", [torch.float32, BF16, torch.float16])
@pytest.mark.parametrize("scale", [1.0, 0.37, 3.5])
def test_quantize_fp8_rounding_boundaries_bit_exact(dtype, scale):
    """The GPU kernels round with the hardware cast (cvt.rn.satfinite): ties to even, the fp32
    neighbours of every tie, subnormals and saturation as the reference (torch's cast)."""
    torch.manual_seed(0)
    v = fp8_hard_values()
    x = v[: v.numel() // 101 * 101].to(DEV, dtype).reshape(-1, 101)  # odd row length
    s = torch.tensor(scale, device=DEV)
    ref = qref.quantize_fp8(x, s)
    for tactic in tq.QUANTIZE_TACTICS:
        assert same_bits(tq.quantize_fp8(x, s, tactic=tactic), ref), tactic.name


@needs_fp8
@pytest.mark.parametrize("tactic", cuda_fp8.FP8_GEMM_TACTICS, ids=ids(cuda_fp8.FP8_GEMM_TACTICS))
@pytest.mark.parametrize("N,K", SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_fp8_gemm(tactic, N, K, bias):
    w = torch.randn(N, K, device=DEV) * 0.02
    w_scale = w.abs().max() / 448
    weight = qref.quantize_fp8(w, w_scale)
    b = torch.randn(N, device=DEV, dtype=BF16) if bias else None
    fn = cuda_fp8.make_fp8_linear(tactic)
    for T in TS:
        x = torch.randn(T, K, device=DEV, dtype=BF16)
        in_scale = x.float().abs().max() / 448
        ref = qref.fp8_linear(x, weight, w_scale, in_scale, b)
        out = fn(x, weight, w_scale, in_scale, b)
        assert out.shape == (T, N) and out.dtype == BF16
        assert rel_err(out, ref) < FP8_TOL, T


@needs_fp8
@pytest.mark.parametrize("N,K", SHAPES)
def test_fp8_gemm_fast_accumulation_within_the_fp8_tolerance(N, K):
    """--fp8-fast-accum engines: cuBLASLt without fp32 promotion of partial sums, at prefill and
    large-decode row counts, against the reference's fp32 accumulation (bias fused and not)."""
    w = torch.randn(N, K, device=DEV) * 0.02
    w_scale = w.abs().max() / 448
    weight = qref.quantize_fp8(w, w_scale)
    t = cuda_fp8.FP8_GEMM_TACTICS[0]
    fast = cuda_fp8.make_fp8_linear(cuda_fp8.fast_accum_tactic(t))
    for T, b in ((64, None), (512, torch.randn(N, device=DEV, dtype=BF16)), (2048, None)):
        x = torch.randn(T, K, device=DEV, dtype=BF16)
        in_scale = x.float().abs().max() / 448
        out = fast(x, weight, w_scale, in_scale, b)
        assert out.shape == (T, N) and out.dtype == BF16
        assert rel_err(out, qref.fp8_linear(x, weight, w_scale, in_scale, b)) < FP8_TOL, T


@needs_fp8
@pytest.mark.parametrize("T", [200, 448])
def test_fp8_gemm_on_padded_rows_within_the_fp8_tolerance(T):
    """A tactic's pad_rows: cuBLASLt runs the quantizing kernels' output padded to a multiple
    of 128 rows, on the room under it (NaN poisoned here), and the rows come back finite and
    within the FP8 tolerance of the reference (Llama-3.1-8B's gate_up shape)."""
    from ingot.plugins.quant.row_room import padded_rows
    from ingot.plugins.registry import Tactic

    N, K = 28672, 4096
    w = torch.randn(N, K, device=DEV) * 0.02
    w_scale = w.abs().max() / 448
    weight = qref.quantize_fp8(w, w_scale)
    x = torch.randn(T, K, device=DEV, dtype=BF16)
    norm_w = torch.rand(K, device=DEV, dtype=BF16) + 0.5
    in_scale = torch.tensor(0.02, device=DEV)
    xq = tq.rms_norm_quant_fp8(x, norm_w, 1e-5, in_scale)
    room = xq.as_strided((padded_rows(T), K), (K, 1))  # the producer left the room
    room[T:].view(torch.uint8).fill_(0x7F)  # e4m3fn NaN
    t = cuda_fp8.FP8_GEMM_TACTICS[0]
    for fast in (False, True):
        tactic = Tactic(t.name, t.params + (("pad_rows", "1-"),))
        fn = cuda_fp8.make_fp8_linear(cuda_fp8.fast_accum_tactic(tactic, "1-") if fast else tactic)
        out = fn(xq, weight, w_scale, in_scale, out_dtype=BF16)
        assert out.shape == (T, N) and torch.isfinite(out).all(), fast
        ref = qref.fp8_linear(xq, weight, w_scale, in_scale, None, out_dtype=BF16)
        assert rel_err(out, ref) < FP8_TOL, fast


FP8_GEMVS = [t for t in cuda_fp8.FP8_GEMM_TACTICS if t.as_dict().get("max_m")]


@needs_fp8
@pytest.mark.parametrize("tactic", FP8_GEMVS, ids=ids(FP8_GEMVS))
def test_fp8_swiglu_gemv_equals_unfused(tactic):
    """The FP8 down projection with SwiGLU-quantize folded into its GEMV agrees with the
    SwiGLU-quantize kernel then the same GEMV (Llama-3.1-8B's down shape) to one bf16 ulp per
    element, and with the reference's values.

    NOTE: not bit for bit on the GPU (the H200 run had 4 of 5 tactics differ): x arrives as bf16
    instead of fp8, so the compiler lays the tile out differently and sums the fp32 products in
    another order. The Triton interpreter checks the exact bits (test_fp8_swiglu_gemv)."""
    n, inter = 4096, 14336
    w = torch.randn(n, inter, device=DEV) * 0.02
    ws, xs = w.abs().max() / 448, torch.tensor(0.02, device=DEV)
    weight = qref.quantize_fp8(w, ws)
    fused = cuda_fp8.make_fp8_swiglu_linear(tactic)
    for T in range(1, tactic.as_dict()["max_m"] + 1):
        gate_up = torch.randn(T, 2 * inter, device=DEV, dtype=BF16)
        out = fused(gate_up, weight, ws, xs)
        act = tq.make_swiglu_quant_fp8(None)(gate_up, xs)
        unfused = cuda_fp8.make_fp8_linear(tactic)(act, weight, ws, xs, out_dtype=BF16).float()
        ulp = unfused.abs() * 2**-7  # a bf16 ulp is at most 2^-7 of the value
        assert ((out.float() - unfused).abs() <= ulp + 1e-6).all()
        assert rel_err(out, qref.fp8_swiglu_linear(gate_up, weight, ws, xs)) < FP8_TOL


@needs_fp8
def test_fp8_gemm_odd_shapes_and_prequantized_x():
    fn = cuda_fp8.make_fp8_linear(None)
    for N, K, dtype in ((37, 128, BF16), (48, 200, torch.float32), (4096, 4096, torch.float32)):
        w = torch.randn(N, K, device=DEV) * 0.02
        weight = qref.quantize_fp8(w, w.abs().max() / 448)
        ws, xs = w.abs().max() / 448, torch.tensor(0.01, device=DEV)
        x = torch.randn(5, K, device=DEV, dtype=dtype)
        b = torch.randn(N, device=DEV, dtype=dtype)
        ref = qref.fp8_linear(x, weight, ws, xs, b)
        assert rel_err(fn(x, weight, ws, xs, b), ref) < FP8_TOL
        xq = tq.quantize_fp8(x, xs)
        assert rel_err(fn(xq, weight, ws, xs, b, out_dtype=dtype), ref) < FP8_TOL


@needs_fp8
@pytest.mark.parametrize("residual", [False, True])
def test_rms_norm_quant_fp8(residual):
    x = torch.randn(37, 4096, device=DEV, dtype=BF16)
    r = torch.randn(37, 4096, device=DEV, dtype=BF16)
    w = (1 + 0.1 * torch.randn(4096, device=DEV)).to(BF16)
    s = torch.tensor(0.02, device=DEV)
    if residual:
        out, new_r = tq.rms_norm_quant_fp8(x, w, 1e-5, s, r)
        ref, ref_r = qref.rms_norm_quant_fp8(x, w, 1e-5, s, r)
        assert torch.equal(new_r, ref_r)
    else:
        out, ref = tq.rms_norm_quant_fp8(x, w, 1e-5, s), qref.rms_norm_quant_fp8(x, w, 1e-5, s)
    assert (out.view(torch.uint8) != ref.view(torch.uint8)).float().mean() < 0.02
    assert rel_err(out.float(), ref.float()) < FP8_TOL


@needs_fp8
def test_swiglu_quant_fp8():
    x = torch.randn(9, 2 * 14336, device=DEV, dtype=BF16)
    s = torch.tensor(0.01, device=DEV)
    out = tq.swiglu_quant_fp8(x, s)
    ref = qref.swiglu_quant_fp8(x, s)
    assert (out.view(torch.uint8) != ref.view(torch.uint8)).float().mean() < 0.02
    assert rel_err(out.float(), ref.float()) < FP8_TOL


# --------------------------------------------------------------------------- W4A16


def _w4(N: int, K: int, dtype=BF16):
    codes = torch.randint(0, 16, (N, K), device=DEV)
    qweight = qref.pack_w4_engine(codes.cpu()).to(DEV)  # [N, K/8]
    scales = (torch.rand(N, K // 128, device=DEV) * 0.02 + 0.002).to(dtype)
    pqs = (torch.rand(K, device=DEV) + 0.5).to(dtype)
    return qweight, scales, pqs


@pytest.mark.parametrize("tactic", tw.W4A16_TACTICS, ids=ids(tw.W4A16_TACTICS))
@pytest.mark.parametrize("N,K", SHAPES)
def test_w4a16_gemm(tactic, N, K):
    qweight, scales, pqs = _w4(N, K)
    b = torch.randn(N, device=DEV, dtype=BF16)
    fn = tw.make_w4a16_linear(tactic)
    for T in TS:
        x = torch.randn(T, K, device=DEV, dtype=BF16)
        for bias in (None, b):
            ref = qref.w4a16_linear(x, qweight, scales, pqs, 128, None, bias)
            out = torch.full((T, N), float("nan"), device=DEV, dtype=BF16)
            assert fn(x, qweight, scales, pqs, 128, None, bias, out=out) is out
            assert rel_err(out, ref) < W4_TOL, (T, bias is not None)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_w4a16_other_dtypes_and_fallbacks(dtype):
    N, K = 4096, 4096
    qweight, scales, pqs = _w4(N, K, dtype)
    fn = tw.make_w4a16_linear(None)
    for T in (1, 2, 33):
        x = torch.randn(T, K, device=DEV, dtype=dtype)
        ref = qref.w4a16_linear(x, qweight, scales, pqs, 128)
        assert rel_err(fn(x, qweight, scales, pqs, 128), ref) < W4_TOL
        assert rel_err(fn(x, qweight, scales, None, 128), qref.w4a16_linear(
            x, qweight, scales, None, 128)) < W4_TOL  # fmt: skip
    zeros = torch.full_like(scales, 8, dtype=torch.int32)  # asymmetric: the reference path
    x = torch.randn(3, K, device=DEV, dtype=dtype)
    ref = qref.w4a16_linear(x, qweight, scales, pqs, 128, zeros)
    assert rel_err(fn(x, qweight, scales, pqs, 128, zeros), ref) < W4_TOL


def test_w4a16_cuda_graph():
    N, K = 6144, 4096
    qweight, scales, pqs = _w4(N, K)
    fn = tw.make_w4a16_linear(None)
    x = torch.randn(1, K, device=DEV, dtype=BF16)
    out = torch.empty(1, N, device=DEV, dtype=BF16)
    fn(x, qweight, scales, pqs, 128, out=out)  # warm-up compiles outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn(x, qweight, scales, pqs, 128, out=out)
    x.copy_(torch.randn_like(x))
    out.fill_(float("nan"))
    g.replay()
    assert rel_err(out, qref.w4a16_linear(x, qweight, scales, pqs, 128)) < W4_TOL


# the packed CUDA-core GEMV (mma tactics carry `packed` for the calls their kernel leaves)
PACKED = [t for t in tw.DECODE_TACTICS if t.as_dict().get("packed") and not t.as_dict().get("mma")]


@pytest.mark.parametrize("tactic", PACKED, ids=ids(PACKED))
def test_w4a16_packed_gemv_does_its_bf16x2_arithmetic(tactic):
    """The packed GEMV's PTX (code - 8 in bf16x2, each half word's 4 products summed in bf16)
    against the torch model of that arithmetic (kernel_checks.w4a16_packed_model): only the
    fp32 additions' order differs, so the bound is far tighter than W4_TOL (bf16 sums of the
    wrong width or a half paired with the wrong activations miss it by 10-1000x)."""
    params = tactic.as_dict()
    for N, K in ((6144, 4096), (4096, 14336)):
        qweight, scales, pqs = _w4(N, K)
        for T in range(1, int(params["max_m"]) + 1):
            x = torch.randn(T, K, device=DEV, dtype=BF16)
            out = torch.full((T, N), float("nan"), device=DEV)  # fp32: before the output's cast
            tw.launch_w4a16(x, qweight, scales, pqs, 128, None, out, params, True)
            assert rel_err(out, w4a16_packed_model(x, qweight, scales, pqs)) < 1e-4, (N, T)


PERSISTENT = [t for t in tw.DECODE_TACTICS if t.as_dict().get("persist")]


@pytest.mark.parametrize("tactic", PERSISTENT, ids=ids(PERSISTENT))
def test_w4a16_persistent_gemv_is_the_plain_kernel_at_llama_shapes(tactic):
    """Resident programs (`persist` per SM of this GPU) over the tiles of Llama-3.1-8B's four
    sites: the plain kernel's bits with the same blocks, with and without
    PDL; every output element written (NaN poison)."""
    from ingot.plugins import pdl

    params = tactic.as_dict()
    plain = {k: v for k, v in params.items() if k != "persist"}
    for N, K in SHAPES:
        qweight, scales, pqs = _w4(N, K)
        x = torch.randn(1, K, device=DEV, dtype=BF16)
        want = tw.launch_w4a16(x, qweight, scales, pqs, 128, None,
                               torch.empty(1, N, device=DEV, dtype=BF16), plain, True)  # fmt: skip
        for on in (False, True):
            out = torch.full((1, N), float("nan"), device=DEV, dtype=BF16)
            with pdl.scope(on):
                tw.launch_w4a16(x, qweight, scales, pqs, 128, None, out, params, True)
            assert torch.equal(out, want), (N, K, on)


MMA = [t for t in tw.DECODE_TACTICS if t.as_dict().get("mma")]


@pytest.mark.parametrize("tactic", MMA, ids=ids(MMA))
def test_w4a16_mma_gemv_llama_shapes(tactic):
    """The tensor-core GEMV (inline mma.sync, fragments from each lane's registers) at the
    four Llama-3.1-8B sites and a ragged one, x rows 1 to 8: fp32 sums within 1e-4 of the
    fp64 product of x * pre_quant_scale (rounded to bf16, as the kernel and the reference
    do) and the dequantized weight (a fragment in the wrong lane is off by O(1)); the bf16
    output within W4_TOL of the reference; the PDL variant gives the same bits; NaN poison."""
    from ingot.plugins import pdl

    params = tactic.as_dict()
    for N, K in (*SHAPES, (1000, 384)):
        qweight, scales, pqs = _w4(N, K)
        w = qref.dequantize_w4(qweight, scales, 128).double()
        for T in (1, 2, 5, 8):
            x = torch.randn(T, K, device=DEV, dtype=BF16)
            sums = torch.full((T, N), float("nan"), device=DEV)
            tw.launch_w4a16(x, qweight, scales, pqs, 128, None, sums, params, True)
            exact = (x * pqs).double() @ w.t()
            assert rel_err(sums, exact) < 1e-4, (N, K, T)
            out = torch.full((T, N), float("nan"), device=DEV, dtype=BF16)
            tw.launch_w4a16(x, qweight, scales, pqs, 128, None, out, params, True)
            assert rel_err(out, qref.w4a16_linear(x, qweight, scales, pqs, 128)) < W4_TOL
            with pdl.scope(True):
                again = tw.launch_w4a16(x, qweight, scales, pqs, 128, None, torch.empty_like(out),
                                        params, True)  # fmt: skip
            assert torch.equal(again, out), (N, K, T)


@pytest.mark.parametrize("small", tw.SMALL_TACTICS, ids=ids(tw.SMALL_TACTICS))
def test_w4a16_small_batch_half_llama_shapes(small):
    """The plugin with a small-batch half (combine_tactics(dec, mm, small)) at decode batches
    of 2, 4 and 8 rows, the down projection gated ([gate | up], SwiGLU before the GEMV): within
    W4_TOL of the reference at the Llama-3.1-8B sites; NaN poison in `out`."""
    fn = tw.make_w4a16_linear(tw.combine_tactics(tw.DECODE_TACTICS[0], tw.GEMM_TACTICS[0], small))
    for N, K in SHAPES:
        qweight, scales, pqs = _w4(N, K)
        for T, gated in ((2, False), (4, True), (8, False), (8, True)):
            x = torch.randn(T, 2 * K if gated else K, device=DEV, dtype=BF16)
            out = torch.full((T, N), float("nan"), device=DEV, dtype=BF16)
            fn(x, qweight, scales, pqs, 128, out=out, gated=gated)
            ref = qref.w4a16_linear(x, qweight, scales, pqs, 128, gated=gated)
            assert rel_err(out, ref) < W4_TOL, (N, K, T, gated)


@pytest.mark.parametrize("mid", tw.MID_TACTICS, ids=ids(tw.MID_TACTICS))
def test_w4a16_mid_batch_half_llama_shapes(mid):
    """The plugin with a medium-batch half (combine_tactics(dec, mm, small, mid), a split-K
    GEMM) at decode batches of 9, 16, 33 and 64 rows, the down projection gated ([gate |
    up], SwiGLU before it), with bias at 16 rows: within W4_TOL of the reference at the
    Llama-3.1-8B sites; NaN poison in `out`; the same bits on a second run."""
    fn = tw.make_w4a16_linear(
        tw.combine_tactics(tw.DECODE_TACTICS[0], tw.GEMM_TACTICS[0], tw.SMALL_TACTICS[0], mid)
    )
    for N, K in SHAPES:
        qweight, scales, pqs = _w4(N, K)
        for T, gated in ((9, False), (16, True), (33, False), (64, True)):
            x = torch.randn(T, 2 * K if gated else K, device=DEV, dtype=BF16)
            bias = torch.randn(N, device=DEV, dtype=BF16) if T == 16 else None
            out = torch.full((T, N), float("nan"), device=DEV, dtype=BF16)
            fn(x, qweight, scales, pqs, 128, None, bias, out=out, gated=gated)
            ref = qref.w4a16_linear(x, qweight, scales, pqs, 128, None, bias, gated=gated)
            assert rel_err(out, ref) < W4_TOL, (N, K, T, gated)
            again = fn(x, qweight, scales, pqs, 128, None, bias, gated=gated)
            assert torch.equal(again, out), (N, K, T, gated)


# a program's rows hold whole RoPE pairs: two rows or more
W4_ROPE = [t for t in tw.DECODE_TACTICS if t.as_dict()["block_n"] >= 2]


@pytest.mark.parametrize("tactic", W4_ROPE, ids=ids(W4_ROPE))
@pytest.mark.parametrize("kv_dtype", [BF16, F8], ids=["bf16_kv", "fp8_kv"])
def test_w4a16_qkv_rope_gemv_llama_shapes(tactic, kv_dtype):
    """The W4A16 QKV GEMV with RoPE + KV write in its epilogue (plugin w4a16_qkv_rope_gemm)
    against the W4A16 GEMV then the RoPE kernel and the reference: Llama-3.1-8B heads,
    K = 4,096, with bias and without, every row count the tactic fuses."""
    from kernel_checks import w4a16_qkv_rope_fused_vs_unfused

    pair = tw.combine_tactics(tactic, tw.GEMM_TACTICS[0])
    for T in range(1, tactic.as_dict()["max_m"] + 1):
        w4a16_qkv_rope_fused_vs_unfused(pair, T, 32, 8, 128, kv_dtype, bias=T % 2 == 0,
                                        exact=False, device=DEV, K=4096)  # fmt: skip


# the down projection's candidates: every decode tactic, and the non-mma ones' twins that run
# the SwiGLU kernel first (`swiglu_apart`)
DOWN_TACTICS = tw.decode_candidates(gated=True)


@pytest.mark.parametrize("tactic", DOWN_TACTICS, ids=ids(DOWN_TACTICS))
def test_w4a16_gemv_applies_swiglu_as_it_loads(tactic):
    """gated=True at the down projection's shape: the GEMV given [gate | up] writes the bits
    the GEMV gives on the SwiGLU kernel's output (the same fp32 math rounded once), for every
    decode tactic (and `swiglu_apart` twin) and row count up to its max_m; past max_m,
    SwiGLU then the GEMM."""
    from ingot.plugins.activation.triton_kernels import make_swiglu

    N, K = 4096, 14336
    qweight, scales, pqs = _w4(N, K)
    fn = tw.make_w4a16_linear(tw.combine_tactics(tactic, tw.GEMM_TACTICS[0]))
    max_m = int(tactic.as_dict()["max_m"])
    for T in (*range(1, max_m + 1), max_m + 1, 64):
        gate_up = torch.randn(T, 2 * K, device=DEV, dtype=BF16)
        out = torch.full((T, N), float("nan"), device=DEV, dtype=BF16)
        fn(gate_up, qweight, scales, pqs, 128, out=out, gated=True)
        unfused = fn(make_swiglu(None)(gate_up), qweight, scales, pqs, 128)
        assert torch.equal(out, unfused), T
        ref = qref.w4a16_linear(gate_up, qweight, scales, pqs, 128, gated=True)
        assert rel_err(out, ref) < W4_TOL, T


# --------------------------------------------------------------------------- FP8 KV cache

HQ, HKV, HD, BS = 32, 8, 128, 16
K_SCALE, V_SCALE = 6.0 / 448, 3.0 / 448


def _fp8_cache(ctx: list[int], dtype=BF16, bs=BS, transposed=True):
    """FP8 caches holding random K/V for each sequence; V transposed per block as FP8 pools
    store it (transposed=False: token-major like K, which the kernels still take)."""
    B = len(ctx)
    width = -(-max(ctx) // bs)
    nb = B * width + 3
    bt = torch.randperm(nb, device=DEV)[: B * width].reshape(B, width).int()
    kc = torch.zeros(nb, bs, HKV, HD, device=DEV, dtype=F8)
    vc = v_like(kc, transposed)
    sc = {
        "k_scale": torch.tensor(K_SCALE, device=DEV),
        "v_scale": torch.tensor(V_SCALE, device=DEV),
    }
    for b in range(B):
        t = torch.arange(ctx[b], device=DEV)
        slots = (bt[b, t // bs].long() * bs + t % bs).int()
        k = torch.randn(ctx[b], HKV, HD, device=DEV, dtype=dtype)
        v = torch.randn(ctx[b], HKV, HD, device=DEV, dtype=dtype)
        attn_ref.write_kv(k, v, kc, vc, slots, **sc)
    return kc, vc, bt, torch.tensor(ctx, device=DEV).int(), sc


@needs_fp8
@pytest.mark.parametrize("tactic", kvw.KV_WRITE_TACTICS, ids=ids(kvw.KV_WRITE_TACTICS))
def test_fp8_kv_write_bit_exact(tactic):
    T, nb = 300, 64
    k = torch.randn(T, HKV, HD, device=DEV, dtype=BF16) * 3
    v = torch.randn(T, HKV, HD, device=DEV, dtype=BF16)
    slots = torch.randperm(nb * BS, device=DEV)[:T].int()
    sc = {
        "k_scale": torch.tensor(K_SCALE, device=DEV),
        "v_scale": torch.tensor(V_SCALE, device=DEV),
    }
    kc = torch.zeros(nb, BS, HKV, HD, device=DEV, dtype=F8)
    vc = v_like(kc)  # transposed per block, as FP8 pools store it
    kc_r, vc_r = kc.clone(), torch.zeros_like(kc)  # the reference: V token-major
    attn_ref.write_kv(k, v, kc_r, vc_r, slots, **sc)
    kvw.make_write_kv(tactic)(k, v, kc, vc, slots, **sc)
    assert is_transposed(vc) and same_bits(kc, kc_r) and same_bits(vc, vc_r)


@needs_fp8
def test_rope_write_kv_fp8_bit_exact_with_unfused():
    """RoPE fused with the FP8 KV write = RoPE, then the FP8 KV write (bits)."""
    T, nb = 300, 64
    q = torch.randn(T, 32, HD, device=DEV, dtype=BF16)
    k = torch.randn(T, HKV, HD, device=DEV, dtype=BF16) * 3
    v = torch.randn(T, HKV, HD, device=DEV, dtype=BF16)
    pos = torch.randint(0, 4096, (T,), device=DEV).int()
    theta = torch.rand(4096, HD // 2, device=DEV) * 6
    cos, sin = torch.cat([theta.cos()] * 2, -1), torch.cat([theta.sin()] * 2, -1)
    slots = torch.randperm(nb * BS, device=DEV)[:T].int()
    slots[7] = -1  # padding: skipped
    sc = {
        "k_scale": torch.tensor(K_SCALE, device=DEV),
        "v_scale": torch.tensor(V_SCALE, device=DEV),
    }
    rope_fp8_write_fused_vs_unfused(q, k, v, pos, cos, sin, slots, sc, (nb, BS, HKV, HD))


@needs_fp8
@pytest.mark.parametrize("transposed", [True, False], ids=["v_transposed", "v_rows"])
@pytest.mark.parametrize("bs", [16, 64])  # tiles across blocks; tiles inside one block
@pytest.mark.parametrize("tactic", dec.DECODE_TACTICS, ids=ids(dec.DECODE_TACTICS))
def test_fp8_decode(tactic, bs, transposed):
    ctx = [1, 17, 300, 1100, 64]
    kc, vc, bt, cl, sc = _fp8_cache(ctx, bs=bs, transposed=transposed)
    q = torch.randn(len(ctx), HQ, HD, device=DEV, dtype=BF16)
    qsl = torch.arange(len(ctx) + 1, device=DEV).int()
    ref = attn_ref.paged_attention(q, kc, vc, bt, cl, qsl, HD**-0.5, **sc)
    out = torch.full_like(q, float("nan"))
    dec.make_decode_attention(tactic)(q, kc, vc, bt, cl, qsl, HD**-0.5, out=out, **sc)
    assert rel_err(out, ref) < FP8_TOL


@needs_fp8
@pytest.mark.parametrize("transposed", [True, False], ids=["v_transposed", "v_rows"])
@pytest.mark.parametrize("bs", [16, 128])
@pytest.mark.parametrize("tactic", ALL_PREFILL, ids=ids(ALL_PREFILL))
def test_fp8_prefill(tactic, bs, transposed):
    new, ctx = [300, 1, 77], [300, 40, 500]  # a prompt, a decode row, a chunk after a prefix
    kc, vc, bt, cl, sc = _fp8_cache(ctx, bs=bs, transposed=transposed)
    qsl = torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()], device=DEV).int()
    q = torch.randn(sum(new), HQ, HD, device=DEV, dtype=BF16)
    ref = attn_ref.paged_attention(q, kc, vc, bt, cl, qsl, HD**-0.5, **sc)
    out = torch.full_like(q, float("nan"))
    pf.make_prefill_attention(tactic)(q, kc, vc, bt, cl, qsl, HD**-0.5, out=out, **sc)
    assert rel_err(out, ref) < FP8_TOL
    out2 = dec.make_paged_attention(None)(
        q, kc, vc, bt, cl, qsl, HD**-0.5, max_query_len=max(new), **sc
    )
    assert rel_err(out2, ref) < FP8_TOL


@needs_fp8
@pytest.mark.parametrize("bs", [16, 32])
@pytest.mark.parametrize("tactic", ALL_PREFILL, ids=ids(ALL_PREFILL))
def test_fp8_prefill_with_fp8_queries(tactic, bs):
    """fp8_queries (Q.K on FP8 tensor cores, each query row rounded with its own scale): the
    reference on the rounded queries within the FP8 tolerance, and nearer to it than to the
    unrounded queries' (q scaled up so that the rounding shows in the output)."""
    new, ctx = [300, 1, 77], [300, 40, 500]
    kc, vc, bt, cl, sc = _fp8_cache(ctx, bs=bs)
    qsl = torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()], device=DEV).int()
    q = torch.randn(sum(new), HQ, HD, device=DEV, dtype=BF16) * 3
    rows = attn_ref.fp8_query_rows(q)
    ref = attn_ref.paged_attention(rows, kc, vc, bt, cl, qsl, HD**-0.5, **sc)
    plain = attn_ref.paged_attention(q, kc, vc, bt, cl, qsl, HD**-0.5, **sc)
    out = torch.full_like(q, float("nan"))
    pf.make_prefill_attention(tactic)(q, kc, vc, bt, cl, qsl, HD**-0.5, out=out,
                                      fp8_queries=True, **sc)  # fmt: skip
    assert rel_err(out, ref) < FP8_TOL
    assert rel_err(out, ref) < 0.5 * rel_err(out, plain)


@needs_fp8
@pytest.mark.parametrize("variant", [(64, 4, 2), (128, 8, 2)], ids=str)
@pytest.mark.parametrize("bs", [16, 32])
def test_decode_fp8mma_experiment_precision(variant, bs):
    """triton_decode_fp8mma (EXPERIMENT: both dots on FP8 wgmma, swapped), contexts of one key,
    around a tile and of many blocks. Queries and P rounded once: near the reference on
    rounded queries. In two FP8 terms each (the default): near the reference itself, and at
    most half as far from it as rounded once; the FP8 output too."""
    from ingot.plugins.attention import triton_decode_fp8mma as f8mma

    ctx = [1, 63, 64, 65, 300, 1100]
    kc, vc, bt, cl, sc = _fp8_cache(ctx, bs=bs)
    qsl = torch.arange(len(ctx) + 1, device=DEV).int()
    q = torch.randn(len(ctx), HQ, HD, device=DEV, dtype=BF16) * 3
    ref = attn_ref.paged_attention(q, kc, vc, bt, cl, qsl, HD**-0.5, **sc)
    rounded = attn_ref.paged_attention(attn_ref.fp8_query_rows(q), kc, vc, bt, cl, qsl,
                                       HD**-0.5, **sc)  # fmt: skip
    n, w, st = variant
    args = (q, kc, vc, bt, cl, HD**-0.5, sc["k_scale"], sc["v_scale"])
    kw = {"block_n": n, "num_warps": w, "num_stages": st}
    once = f8mma.decode_fp8mma(*args, two_term=False, **kw)
    two = f8mma.decode_fp8mma(*args, **kw)
    assert rel_err(once, rounded) < 2e-2
    assert rel_err(two, ref) < min(1e-2, 0.5 * rel_err(once, ref))
    os_ = torch.tensor(0.02, device=DEV)
    assert same_bits(f8mma.decode_fp8mma(*args, out_scale=os_, **kw), qref.quantize_fp8(two, os_))


@needs_fp8
@pytest.mark.parametrize(
    "decode", [dec.DECODE_TACTICS[0], dec.DECODE_TACTICS[-2]], ids=lambda t: t.name
)
def test_fp8_attention_output_quantized_bit_exact(decode):
    """out_scale (the FP8 o projection's input): every path stores the bits of the quantize
    kernel applied to the bf16 output: decode with the context split (merged in the last
    program) and not, prefill, and a mixed step's trailing decodes."""
    fn = dec.make_paged_attention(dec.combine_tactics(decode, pf.PREFILL_TACTICS[0]))
    cases = (
        ([1] * 5, [1, 17, 300, 1100, 64], 1, 0, 4096),  # decode, splits
        ([1] * 5, [1, 17, 300, 1100, 64], 1, 0, 64),  # decode, one split
        ([300, 77, 1, 1], [300, 500, 40, 900], 300, 2, None),  # prefill rows, then decodes
    )
    for new, ctx, max_q, nd, max_ctx in cases:
        kc, vc, bt, cl, sc = _fp8_cache(ctx)
        qsl = torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()], device=DEV).int()
        q = torch.randn(sum(new), HQ, HD, device=DEV, dtype=BF16)
        kw = dict(max_query_len=max_q, max_context_len=max_ctx, num_decodes=nd, **sc)
        plain = fn(q, kc, vc, bt, cl, qsl, HD**-0.5, **kw)
        os = plain.float().abs().max() / 448
        fused = fn(q, kc, vc, bt, cl, qsl, HD**-0.5, out_scale=os, **kw)
        assert fused.dtype == F8 and same_bits(fused, tq.quantize_fp8(plain, os)), new


@needs_fp8
@pytest.mark.parametrize("transposed", [True, False], ids=["v_transposed", "v_rows"])
@pytest.mark.parametrize("bs", [16, 32, 64])  # segments of 16 tokens; 32-byte sectors
@pytest.mark.parametrize(
    "decode",
    [dec.DECODE_TACTICS[0], dec.DECODE_TACTICS[4], dec.DECODE_TACTICS[-2], dec.DECODE_TACTICS[-1]],
    ids=lambda t: t.name,
)
def test_fp8_decode_rows_v_stored_by_the_attention_kernel(decode, bs, transposed):
    """new_v: the decode kernel stores each decode row's V (a transposed V: the segment of its
    block around it, stored whole) and attends to it: the cache's bits equal the V stored first
    and the output does to summation order, through split contexts (the last split stores it),
    one split, a batch past LARGE_BATCH_ROWS and a mixed step's trailing decodes."""
    torch.manual_seed(21)
    fn = dec.make_paged_attention(dec.combine_tactics(decode, pf.PREFILL_TACTICS[0], decode))
    many = torch.randint(1, 700, (40,)).tolist()
    cases = (
        ([1] * 7, [1, 17, 300, 1100, 64, 33, 32], 1, 0, 4096),  # decode, splits
        ([1] * 7, [1, 17, 300, 1100, 64, 33, 32], 1, 0, 64),  # decode, one split
        ([1] * 40, many, 1, 0, None),  # 40 x 8 kv heads: the large-batch tactic
        ([300, 77, 1, 1], [300, 500, 40, 900], 300, 2, None),  # prefill rows, then decodes
    )
    for new, ctx, max_q, nd, max_ctx in cases:
        kc, vc, bt, cl, sc = _fp8_cache(ctx, bs=bs, transposed=transposed)
        qsl = torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()], device=DEV).int()
        q = torch.randn(sum(new), HQ, HD, device=DEV, dtype=BF16)
        kw = dict(max_query_len=max_q, max_context_len=max_ctx, num_decodes=nd, **sc)
        new_v_stored_by_attention(fn, q, kc, vc, bt, cl, qsl, HD**-0.5, kw)


@needs_fp8
def test_fp8_attention_queries_past_fp16_range():
    """With an FP8 cache the dots run in fp16 on q / 16: a bf16 query past fp16's 65504 must
    not overflow (unscaled, or scaled after the fp16 conversion, which LLVM once rewrote it
    to, the scores turn inf and the output NaN)."""
    ctx = [40, 300]
    kc, vc, bt, cl, sc = _fp8_cache(ctx, bs=32)
    q = torch.randn(len(ctx), HQ, HD, device=DEV, dtype=BF16)
    q[:, :, :4] *= 2e5 / 3
    qsl = torch.arange(len(ctx) + 1, device=DEV).int()
    # fp32 reference: bf16 rounds the dequantized K, too coarse for scores this large
    ref = attn_ref.paged_attention(q.float(), kc, vc, bt, cl, qsl, HD**-0.5, **sc)
    assert q.abs().max() > 65504 and torch.isfinite(ref).all()
    for tactic in (dec.DECODE_TACTICS[0], dec.DECODE_TACTICS[4]):
        out = torch.full_like(q, float("nan"))
        dec.make_decode_attention(tactic)(q, kc, vc, bt, cl, qsl, HD**-0.5, out=out, **sc)
        assert rel_err(out, ref) < FP8_TOL
    out = torch.full_like(q, float("nan"))
    pf.make_prefill_attention(None)(q, kc, vc, bt, cl, qsl, HD**-0.5, out=out, **sc)
    assert rel_err(out, ref) < FP8_TOL


@pytest.mark.parametrize("bs", [16, 32, 64])
def test_v_segments_write_the_per_token_bytes(bs, monkeypatch):
    """A prefill's V into the FP8 pool a segment of tokens at a time: the same cache bytes as
    token by token, for prompts, a chunk continuing mid-block, scattered slots and padding
    (tests/v_segment_checks.py)."""
    from v_segment_checks import v_segments_equal_per_token

    v_segments_equal_per_token(bs, "cuda", monkeypatch)
    v_segments_equal_per_token(bs, "cuda", monkeypatch, v_rows_cut=3)


# --------------------------------------------------------------------------- export


@pytest.mark.parametrize("mode", ["int4_awq", "fp8"])
@pytest.mark.parametrize("shared_scale", [True, False])
def test_export_on_the_gpu_gives_the_host_tensors_on_the_host(mode, shared_scale):
    """Quantized export makes each linear's tensors where the calibrated model lives
    (compiler/quantize/export.py): from a fused linear's parts on the GPU it returns host
    tensors, bit for bit those of the same parts on the host. Pre-quant scales 1 and 0.5 (a
    mean both devices compute exactly) or one shared scale."""
    from types import SimpleNamespace

    from ingot.compiler.quantize import export
    from ingot.runtime.config import QuantConfig

    g = torch.Generator().manual_seed(3)
    k, rows = 256, (96, 64)
    scales = [torch.ones(k), torch.full((k,), 0.5 if not shared_scale else 1.0)]

    def model_on(device: str):
        mods = {}
        for i, (n, s) in enumerate(zip(rows, scales, strict=True)):
            w = (torch.randn(n, k, generator=g) * 0.02).to(BF16)
            amax = w.float().abs().reshape(n, -1, 128).amax(-1)
            mods[f"p{i}"] = SimpleNamespace(
                weight=w.to(device),
                input_quantizer=SimpleNamespace(pre_quant_scale=s.to(device),
                                                amax=torch.tensor(3.0, device=device)),
                weight_quantizer=SimpleNamespace(amax=amax.to(device) if mode == "int4_awq"
                                                 else w.float().abs().max().to(device)),
            )  # fmt: skip
        return SimpleNamespace(get_submodule=mods.__getitem__)

    def export_on(device: str) -> dict[str, torch.Tensor]:
        g.manual_seed(3)  # the same parts on both devices
        return export._linear(model_on(device), ("p0.weight", "p1.weight"), QuantConfig(mode), BF16)

    host, gpu = export_on("cpu"), export_on(DEV)
    assert set(gpu) == set(host)
    for key, t in gpu.items():
        ref = host[key]
        assert t.device.type == "cpu" and t.dtype == ref.dtype, key
        assert same_bits(t, ref) if t.dtype == F8 else torch.equal(t, ref), key
