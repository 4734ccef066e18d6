"""Dense GEMM and embedding on CUDA; same contracts as `reference.py`.

GEMM: cuBLAS through torch, plus Triton GEMV tactics for decode-sized batches (x with at most
`max_m` rows). Batch-1 decode streams every weight once per token, so a decode GEMM is a pure
weight stream: at these shapes cuBLAS's small-M kernels reach only 53-81% of the copy
bandwidth. The GEMV kernel below reads each weight element once for all T rows of x:

* each program owns BLOCK_N weight rows and walks K in BLOCK_K chunks; a chunk is loaded as
  16-byte vectors (8 bf16 per thread, whole warps along K, so every warp reads 512 contiguous
  bytes of a row), and the loop is either software-pipelined through shared memory with
  `cp.async` (`num_stages` > 1) or unrolled so several chunks are in flight per thread;
* small BLOCK_N (2-8 rows) gives 500+ programs even for N = 4096, so 132 SMs stay full
  without split-K and with no second kernel or workspace (one launch, graph capturable);
* the product is reduced over the 8 elements each thread holds right away
  ([M, N, K/8, 8] -> [M, N, K/8]), which keeps the fp32 accumulator at one register per
  16-byte load and per row of x; the cross-thread reduction happens once, after the loop;
* rows past N are clamped to row 0 (their result is masked at the store), so the weight
  loads in the main loop carry no mask; only a tail chunk (K % BLOCK_K) is masked.

x with more than the tactic's `max_m` rows, K not a multiple of 16 bytes, or unaligned rows
fall back to cuBLAS inside the same tactic; fp32 goes through cuBLAS with TF32 off.
Embedding: torch's gather kernel.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ..pdl import launch_options, pdl_begin
from ..quant.triton_quantize import quant_fp8
from ..registry import Tactic
from .fused_norm import COARSE_FROM, FINE, AddOut, NormIn, add_output, normed_input

_MAX_BLOCK_M = 8  # largest x batch the GEMV kernel handles in one pass (registers)
# the fixed-point sums of squares of a folded norm, as fused_norm.py keeps them
_FINE = tl.constexpr(FINE)
_COARSE_FROM = tl.constexpr(COARSE_FROM)


def gemv_tactic(bn: int, bk: int, w: int, s: int, unroll: int = 1, max_m: int = 1) -> Tactic:
    """A GEMV tactic: BLOCK_N rows per program, BLOCK_K elements per step, up to max_m rows of x."""
    name = f"gemv_n{bn}_k{bk}_w{w}_s{s}" + (f"_u{unroll}" if unroll != 1 else "")
    params = (("block_n", bn), ("block_k", bk), ("num_warps", w), ("num_stages", s),
              ("unroll", unroll), ("max_m", max_m))  # fmt: skip
    return Tactic(name, params)


# block_k >= 256 * num_warps keeps every warp along K (one layout for x and weight chunks).
# max_m: every program re-reads its T rows of x (from L2) per BLOCK_N weight rows, so narrow
# tactics lose to cuBLAS as T grows (H200: n2/k2048 tactics at T=4 ran 1.3-2.4x slower than
# cuBLAS, n8_k1024_w4 matched or beat it); past max_m a tactic hands the call to cuBLAS.
# First (the default when cross-building without a GPU): among the fastest at T=1 on the H200
# for qkv, gate_up and down (scripts/bench_gemv.py).
GEMM_TACTICS: tuple[Tactic, ...] = (
    gemv_tactic(2, 2048, 8, 1, max_m=1),
    Tactic("cublas"),
    gemv_tactic(2, 2048, 8, 1, unroll=2, max_m=1),
    gemv_tactic(2, 1024, 4, 1, unroll=2, max_m=1),
    gemv_tactic(4, 1024, 4, 1, unroll=2, max_m=2),
    gemv_tactic(8, 1024, 4, 1, max_m=4),
    gemv_tactic(4, 1024, 4, 1, max_m=2),
    gemv_tactic(4, 1024, 4, 3, max_m=2),
    gemv_tactic(8, 512, 2, 4, max_m=4),
    gemv_tactic(8, 2048, 8, 2, max_m=1),
)
EMBEDDING_TACTICS: tuple[Tactic, ...] = (Tactic("torch"),)


@triton.jit
def _load_w(w_ptrs, k0, K, MASKED: tl.constexpr, BLOCK_K: tl.constexpr):
    """The weight chunk at k0 (streamed once: evict it first)."""
    if MASKED:
        km = (k0 + tl.arange(0, BLOCK_K)) < K
        return tl.load(w_ptrs + k0, mask=km[None, :], other=0.0, eviction_policy="evict_first")
    return tl.load(w_ptrs + k0, eviction_policy="evict_first")


@triton.jit
def _gemv_fma(
    acc,
    wt,
    x_ptrs,
    k0,
    K,
    sx,
    MASKED: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    VEC: tl.constexpr,
    GATED: tl.constexpr,
    QUANT_X: tl.constexpr,
    NORM: tl.constexpr,
    wn_ptr,
    rstd,
):
    """acc + the products of the weight chunk wt (already loaded) with x's chunk at k0.
    NORM: x is the residual stream, normalized as loaded (rstd [BLOCK_M], the norm's weight
    at wn_ptr; fused_norm.py)."""
    rk = k0 + tl.arange(0, BLOCK_K)
    if MASKED:
        km = rk < K
        xt = tl.load(x_ptrs + k0, mask=km[None, :], other=0.0)
        if GATED:
            ut = tl.load(x_ptrs + K + k0, mask=km[None, :], other=0.0)
        if NORM:
            wn = tl.load(wn_ptr + rk, mask=km, other=0.0)
    else:
        xt = tl.load(x_ptrs + k0)
        if GATED:
            ut = tl.load(x_ptrs + K + k0)
        if NORM:
            wn = tl.load(wn_ptr + rk)
    if NORM:
        # as the add + RMSNorm kernel: rounded to the model dtype after the scale, then after
        # the weight (and, QUANT_X, quantized as the norm-quantize kernel would)
        h = (xt.to(tl.float32) * rstd[:, None]).to(xt.dtype)
        xt = (h.to(tl.float32) * wn.to(tl.float32)[None, :]).to(xt.dtype)
        if QUANT_X:
            xt = quant_fp8(xt.to(tl.float32), sx)
    if GATED:
        # x rows are [gate | up]: silu(gate) * up in fp32, rounded once to the model dtype,
        # exactly as the SwiGLU kernel would have written it (and, QUANT_X, quantized with the
        # FP8 GEMM's input scale as the SwiGLU-quantize kernel would have)
        g = xt.to(tl.float32)
        xt = (g / (1.0 + tl.exp(-g)) * ut.to(tl.float32)).to(xt.dtype)
        if QUANT_X:
            xt = quant_fp8(xt.to(tl.float32), sx)
    w4 = tl.reshape(wt.to(tl.float32), [1, BLOCK_N, BLOCK_K // VEC, VEC])
    x4 = tl.reshape(xt.to(tl.float32), [BLOCK_M, 1, BLOCK_K // VEC, VEC])
    return acc + tl.sum(w4 * x4, axis=3)


@triton.jit
def norm_scale(ss_ptr, rm_c, sss, K, eps, NORM: tl.constexpr, BLOCK_M: tl.constexpr):
    """RMSNorm's 1 / rms [BLOCK_M] of rows rm_c from their fixed-point sums of squares
    (fused_norm.py: the fine sum in 2^-32 units, the coarse one once it reaches 2^30)."""
    if NORM:
        fine = tl.load(ss_ptr + rm_c).to(tl.float32) * (1.0 / _FINE)
        coarse = tl.load(ss_ptr + sss + rm_c)
        ss = tl.where(coarse < _COARSE_FROM, fine, coarse.to(tl.float32))
        return 1.0 / tl.sqrt(ss / K + eps)
    else:
        return tl.full([BLOCK_M], 1.0, tl.float32)


@triton.jit
def gemv_acc(
    x_ptr,
    w_ptr,
    rn_c,
    T,
    K,
    sxm,
    swn,
    sx,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    VEC: tl.constexpr,
    STAGES: tl.constexpr,
    UNROLL: tl.constexpr,
    GATED: tl.constexpr,
    PDL: tl.constexpr,
    QUANT_X: tl.constexpr,
    PRE: tl.constexpr = 1,
    NORM: tl.constexpr = False,
    wn_ptr=None,
    ss_ptr=None,
    sss=0,
    eps=0.0,
):
    """[BLOCK_M, BLOCK_N] fp32 sums of x's first T rows (rows past T re-read row 0) times the
    weight rows rn_c (every index valid), over K: the loop of `_gemv_kernel`, shared with the
    kernels that put their own epilogue after it (plugins/gemm/qkv_rope.py). PDL: the first
    PRE chunks (1, 2 or 4; `prefetch_chunks`) are loaded before the wait. NORM: x is the
    residual stream, RMSNorm-ed with the norm weight at wn_ptr as it is loaded, its rows'
    fixed-point sums of squares at ss_ptr (fine, then coarse sss further; fused_norm.py)."""
    rm = tl.arange(0, BLOCK_M)
    rm_c = tl.where(rm < T, rm, 0)  # rows of x past T re-read row 0; masked at the store
    rk = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + rn_c.to(tl.int64)[:, None] * swn + rk[None, :]
    x_ptrs = x_ptr + rm_c[:, None] * sxm + rk[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K // VEC], tl.float32)
    k_full = (K // BLOCK_K) * BLOCK_K
    START: tl.constexpr = PRE * BLOCK_K if PDL else 0  # where the loop begins
    if PDL:
        # the first PRE chunks (masked: K may be shorter), loaded before the wait and summed
        # after it in the loop's order, so the PDL variant gives the plain one's bits
        w0 = _load_w(w_ptrs, 0, K, True, BLOCK_K)
        if PRE >= 2:
            w1 = _load_w(w_ptrs, BLOCK_K, K, True, BLOCK_K)
        if PRE >= 4:
            w2 = _load_w(w_ptrs, 2 * BLOCK_K, K, True, BLOCK_K)
            w3 = _load_w(w_ptrs, 3 * BLOCK_K, K, True, BLOCK_K)
        pdl_begin(PDL)
        rstd = norm_scale(ss_ptr, rm_c, sss, K, eps, NORM, BLOCK_M)  # (after the wait)
        acc = _gemv_fma(acc, w0, x_ptrs, 0, K, sx, True, BLOCK_M, BLOCK_N, BLOCK_K, VEC,
                        GATED, QUANT_X, NORM, wn_ptr, rstd)  # fmt: skip
        if PRE >= 2:
            acc = _gemv_fma(acc, w1, x_ptrs, BLOCK_K, K, sx, True,
                            BLOCK_M, BLOCK_N, BLOCK_K, VEC, GATED, QUANT_X, NORM, wn_ptr,
                            rstd)  # fmt: skip
        if PRE >= 4:
            acc = _gemv_fma(acc, w2, x_ptrs, 2 * BLOCK_K, K, sx, True,
                            BLOCK_M, BLOCK_N, BLOCK_K, VEC, GATED, QUANT_X, NORM, wn_ptr,
                            rstd)  # fmt: skip
            acc = _gemv_fma(acc, w3, x_ptrs, 3 * BLOCK_K, K, sx, True,
                            BLOCK_M, BLOCK_N, BLOCK_K, VEC, GATED, QUANT_X, NORM, wn_ptr,
                            rstd)  # fmt: skip
    else:
        rstd = norm_scale(ss_ptr, rm_c, sss, K, eps, NORM, BLOCK_M)
    # NOTE: never a lower bound past the upper one (PDL with K < START): the unrolled loop's
    # trip count then came out wrong and it read far past the weights (H200: illegal address
    # with tiny models; scripts/pdl_stress.py)
    k_end = tl.maximum(k_full, START)
    for k0 in tl.range(START, k_end, BLOCK_K, num_stages=STAGES, loop_unroll_factor=UNROLL):
        wt = _load_w(w_ptrs, k0, K, False, BLOCK_K)
        acc = _gemv_fma(acc, wt, x_ptrs, k0, K, sx, False, BLOCK_M, BLOCK_N, BLOCK_K, VEC,
                        GATED, QUANT_X, NORM, wn_ptr, rstd)  # fmt: skip
    if k_full < K and k_full >= START:  # the tail, unless the first chunks were all of K
        wt = _load_w(w_ptrs, k_full, K, True, BLOCK_K)
        acc = _gemv_fma(acc, wt, x_ptrs, k_full, K, sx, True, BLOCK_M, BLOCK_N, BLOCK_K, VEC,
                        GATED, QUANT_X, NORM, wn_ptr, rstd)  # fmt: skip
    return tl.sum(acc, axis=2)


@triton.jit
def gemv_epilogue_inputs(sx_ptr, sw_ptr, b_ptr, rn_c, SCALED: tl.constexpr,
                         HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr):  # fmt: skip
    """(x scale, x scale * weight scale, bias [BLOCK_N] fp32) of a GEMV's epilogue (1, 1 and
    zeros where not SCALED / HAS_BIAS): static tensors, read before the loop and before a PDL
    wait (plugins/pdl.py), so their latency hides under the weight stream."""
    sx = 1.0
    sxw = 1.0
    if SCALED:
        sx = tl.load(sx_ptr)  # QUANT_X quantizes x with it too
        sxw = sx * tl.load(sw_ptr)
    bias = tl.zeros([BLOCK_N], tl.float32)
    if HAS_BIAS:
        bias = tl.load(b_ptr + rn_c).to(tl.float32)  # rows past N re-read row 0: masked later
    return sx, sxw, bias


@triton.jit
def store_add_out(y, out_ptr, o_ptrs, om, rm, mm, sums_ptr, sss):
    """A GEMV's AddOut epilogue (fused_norm.py): y [BLOCK_M, BLOCK_N] rounded to out's dtype
    and added into the residual stream at o_ptrs (rounded again), the new values' squares
    summed per row (rm, in range mm) into the fixed-point sums: fine at sums_ptr, coarse sss
    further."""
    dt = out_ptr.dtype.element_ty
    h = (y.to(dt).to(tl.float32) + tl.load(o_ptrs, mask=om, other=0.0).to(tl.float32)).to(dt)
    tl.store(o_ptrs, h, mask=om)
    h = tl.where(om, h.to(tl.float32), 0.0)
    share = tl.sum(h * h, axis=1)  # [BLOCK_M]: this program's columns
    # fixed point: the sums do not depend on the programs' order (fused_norm.py)
    tl.atomic_add(sums_ptr + rm, (share * _FINE + 0.5).to(tl.int64), mask=mm, sem="relaxed")
    tl.atomic_add(sums_ptr + sss + rm, (share + 0.5).to(tl.int64), mask=mm, sem="relaxed")


@triton.jit
def _gemv_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    sx_ptr,
    sw_ptr,
    out_ptr,
    T,
    N,
    K_v,
    sxm_v,
    swn_v,
    som,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    VEC: tl.constexpr,
    STAGES: tl.constexpr,
    UNROLL: tl.constexpr,
    GATED: tl.constexpr = False,
    SCALED: tl.constexpr = False,
    PDL: tl.constexpr = False,
    QUANT_X: tl.constexpr = False,
    PRE: tl.constexpr = 1,
    NORM: tl.constexpr = False,
    wn_ptr=None,
    ss_ptr=None,
    eps=0.0,
    ADD_OUT: tl.constexpr = False,
    sums_ptr=None,
    sss=0,
):
    """out[m, n] = sum_k x[m, k] * w[n, k] (+ b[n]) for m < T, n in this program's rows.
    GATED: x rows are [gate | up] (2K wide) and x[m, k] = silu(gate[m, k]) * up[m, k].
    SCALED: x and w are FP8 with per-tensor scales (float32 [] at sx_ptr, sw_ptr): the fp32
    sum (products of fp8 values are exact) is multiplied by sx * sw before the bias.
    QUANT_X (with GATED, SCALED): x arrives in the model dtype and is quantized to FP8 with
    sx as it is loaded (the SwiGLU-quantize kernel folded into the FP8 down projection).

    K and the row strides come divided by VEC (16 bytes of the weight's elements), so the
    compiler knows every row starts 16-byte aligned and emits 16-byte weight loads for any K
    that is a multiple of VEC.

    PDL: the weights never depend on the kernel before, so each program loads its first PRE
    weight chunks before waiting for that kernel (`pdl_begin`), and x only after: the first
    DRAM round trips overlap the predecessor's tail (or all of a short kernel such as decode
    attention) instead of following it.

    RMSNorm folded in (fused_norm.py): NORM: x is the residual stream, normalized as loaded
    with the norm weight at wn_ptr and the rows' sums of squares at ss_ptr (QUANT_X: then
    quantized with sx). ADD_OUT: out is the residual stream, and the result is added into it
    (each element rounded to out's dtype first, as the GEMM's output), the rows' sums of
    squares of the new values into sums_ptr (fine sums, then the coarse ones sss further).
    """
    K = K_v * VEC
    pid = tl.program_id(0)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    nm = rn < N
    rn_c = tl.where(nm, rn, 0)  # out-of-range rows re-read row 0; masked at the store
    rm = tl.arange(0, BLOCK_M)
    mm = rm < T
    # the epilogue's scales and bias (static) loaded first, before the wait: after the loop
    # each would be one more round trip at the end of every program
    sx, sxw, bias = gemv_epilogue_inputs(sx_ptr, sw_ptr, b_ptr, rn_c, SCALED, HAS_BIAS, BLOCK_N)
    y = gemv_acc(
        x_ptr, w_ptr, rn_c, T, K, sxm_v * VEC, swn_v * VEC, sx,
        BLOCK_M, BLOCK_N, BLOCK_K, VEC, STAGES, UNROLL, GATED, PDL, QUANT_X, PRE,
        NORM, wn_ptr, ss_ptr, sss, eps,
    )  # fmt: skip
    if SCALED:
        y = y * sxw
    if HAS_BIAS:
        y += bias[None, :]
    o_ptrs = out_ptr + rm[:, None] * som + rn[None, :]
    om = mm[:, None] & nm[None, :]
    if ADD_OUT:
        store_add_out(y, out_ptr, o_ptrs, om, rm, mm, sums_ptr, sss)
    else:
        tl.store(o_ptrs, y.to(out_ptr.dtype.element_ty), mask=om)


def _cublas(x, weight, bias, out):
    if x.dtype == torch.float32:
        # fp32 results must be true fp32: no TF32 inside cuBLAS, whatever the global setting.
        prev = torch.get_float32_matmul_precision()
        if prev != "highest":
            torch.set_float32_matmul_precision("highest")
            try:
                return _cublas_call(x, weight, bias, out)
            finally:
                torch.set_float32_matmul_precision(prev)
    return _cublas_call(x, weight, bias, out)


def _cublas_call(x, weight, bias, out):
    if out is None:
        return F.linear(x, weight, bias)
    if bias is None:
        return torch.matmul(x, weight.t(), out=out)
    return torch.addmm(bias, x, weight.t(), out=out)


# Triton's interpreter runs the kernels on CPU tensors (the CPU tests of the GPU paths).
_GEMV_DEVICES = ("cuda", "meta") + (("cpu",) if os.environ.get("TRITON_INTERPRET") == "1" else ())


def gemv_rows(max_m: int) -> int:
    """The most rows of x a tactic with this max_m runs on the GEMV kernel (0: none): the
    batches a decoder may fold its norms into the GEMVs for (fused_norm.py)."""
    return min(max_m, _MAX_BLOCK_M)


def gemv_ok(
    x, weight, bias, out, max_m: int, gated: bool = False, out_dtype=None,
    norm: NormIn | None = None,
) -> bool:  # fmt: skip
    """Shapes/layouts the GEMV kernel takes: a few rows of x, 16-byte aligned rows (K a
    multiple of 16 bytes: every real model; anything else goes to cuBLAS). gated: x is
    [gate | up], twice weight's K wide. FP8 weights (with FP8 x, or gated or normed x in the
    model dtype, quantized on load) give `out_dtype`. norm: x is normalized on load (its
    weight contiguous, x's dtype)."""
    T = x.shape[0] if x.dim() == 2 else 0
    vec = 16 // weight.element_size()
    f8, halves = torch.float8_e4m3fn, (torch.bfloat16, torch.float16)
    on_load = gated or norm is not None  # x computed from what is loaded: model dtype only
    dtypes_ok = (
        (x.dtype in halves and weight.dtype == x.dtype)  # plain (gated or normed or not)
        or (x.dtype == f8 and weight.dtype == f8 and not on_load)  # FP8, x quantized before
        or (on_load and x.dtype in halves and weight.dtype == f8)  # FP8, x quantized on load
    )
    if norm is not None and (
        norm.weight.dtype != x.dtype
        or norm.weight.shape != (x.shape[-1],)
        or norm.weight.stride(0) != 1
        or norm.sums.shape != (2, T)
        or norm.sums.stride(1) != 1
    ):
        return False
    out_dtype = out_dtype or x.dtype
    return (
        x.dim() == 2
        and 0 < T <= min(max_m, _MAX_BLOCK_M)
        and dtypes_ok
        and out_dtype in (torch.bfloat16, torch.float16, torch.float32)
        and weight.dim() == 2
        and weight.shape[1] * (2 if gated else 1) == x.shape[1]
        and weight.stride(1) == 1
        and x.stride(1) == 1
        and (bias is None or (bias.dim() == 1 and bias.stride(0) == 1))
        and (out is None or (out.dtype == out_dtype and out.dim() == 2 and out.stride(1) == 1))
        and x.device.type in _GEMV_DEVICES  # meta: the AOT dry run records this launch
        and x.shape[1] % vec == 0
        and x.stride(0) % vec == 0
        and weight.stride(0) % vec == 0
        and x.data_ptr() % 16 == 0
        and weight.data_ptr() % 16 == 0
    )


def norm_args(norm: NormIn | None) -> dict:
    """The kernel arguments of a NormIn (`gemv_acc`'s NORM ones; none without one)."""
    if norm is None:
        return {}
    return dict(NORM=True, wn_ptr=norm.weight, ss_ptr=norm.sums, sss=norm.sums.stride(0),
                eps=float(norm.eps))  # fmt: skip


def launch_gemv(
    x, weight, bias, out, params, gated: bool, scales=None, out_dtype=None,
    norm: NormIn | None = None, add: AddOut | None = None,
) -> torch.Tensor:  # fmt: skip
    """The GEMV kernel (`gemv_ok` must hold). scales: (x scale, weight scale) of FP8 weights;
    gated or normed x in the model dtype is then quantized with the x scale as it is loaded.
    norm / add: the RMSNorm folded in (fused_norm.py); with `add` the residual is returned."""
    T = x.shape[0]
    N, K = weight.shape
    if add is not None:
        out = add.residual
    elif out is None:
        out = torch.empty((T, N), dtype=out_dtype or x.dtype, device=x.device)
    bn = int(params["block_n"])
    vec = 16 // weight.element_size()
    sx, sw = scales if scales is not None else (weight, weight)
    folded = norm_args(norm)
    if add is not None:
        if norm is not None and norm.sums.stride(0) != add.sums.stride(0):
            raise ValueError("fused norm: the NormIn and AddOut sums must share a layout")
        folded |= dict(ADD_OUT=True, sums_ptr=add.sums, sss=add.sums.stride(0))
    args = (x, weight, bias if bias is not None else weight, sx, sw, out, T, N, K // vec,
            x.stride(0) // vec, weight.stride(0) // vec, out.stride(0))  # fmt: skip
    kw = dict(HAS_BIAS=bias is not None, BLOCK_M=triton.next_power_of_2(T), BLOCK_N=bn,
              BLOCK_K=int(params["block_k"]), VEC=vec, GATED=gated, SCALED=scales is not None,
              QUANT_X=scales is not None and x.dtype != weight.dtype,
              num_warps=int(params["num_warps"]), num_stages=1, **folded)  # fmt: skip
    _gemv_kernel[(triton.cdiv(N, bn),)](
        *args, STAGES=int(params.get("num_stages", 1)), UNROLL=int(params.get("unroll", 1)), **kw,
        **gemv_pdl_options(K, weight.element_size(), params),
    )  # fmt: skip
    return out


# Bytes of weights each thread may hold in registers before a PDL GEMV's wait (64 registers):
# a GEMV whose programs are all resident (e.g. the o projection after decode attention) then
# reads most of its weights while the kernel before it runs. 0: one chunk.
PREFETCH_BYTES = 256


def prefetch_chunks(K: int, elem_bytes: int, params: dict) -> int:
    """Weight chunks a PDL GEMV loads before its wait (1, 2 or 4): the most that fit
    PREFETCH_BYTES per thread without a chunk wholly past K; at least one."""
    bk, bn, warps = int(params["block_k"]), int(params["block_n"]), int(params["num_warps"])
    per_chunk = bn * bk * elem_bytes // (32 * warps)
    pre = 1
    while pre < 4 and 2 * pre * per_chunk <= PREFETCH_BYTES and 2 * pre <= triton.cdiv(K, bk):
        pre *= 2
    return pre


def gemv_pdl_options(K: int, elem_bytes: int, params: dict) -> dict:
    """launch_options() of a GEMV-loop kernel, with its PRE when PDL is on."""
    opts = launch_options()
    return opts | {"PRE": prefetch_chunks(K, elem_bytes, params)} if opts else opts


def make_linear(tactic: Tactic | None = None):
    params = tactic.as_dict() if tactic is not None else {}
    max_m = int(params.get("max_m", 0))  # 0: cuBLAS only

    def linear(
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        out: torch.Tensor | None = None,
        *,
        norm: NormIn | None = None,
        add: AddOut | None = None,
    ) -> torch.Tensor:
        """x: [T, K], weight: [N, K], bias: [N] | None -> [T, N] (written into `out` if given).
        norm / add: the RMSNorm folded in (fused_norm.py; `add` returns the residual)."""
        out = add.residual if add is not None else out
        if max_m and gemv_ok(x, weight, bias, out, max_m, norm=norm):
            return launch_gemv(x, weight, bias, out, params, False, norm=norm, add=add)
        y = _cublas(normed_input(x, norm) if norm is not None else x, weight, bias,
                    None if add is not None else out)  # fmt: skip
        return add_output(y, add) if add is not None else y

    linear.gemv_rows = gemv_rows(max_m)
    return linear


def make_swiglu_linear(tactic: Tactic | None = None):
    """SwiGLU fused into the GEMM after it (the MLP down projection): for decode-sized T the
    GEMV computes silu(gate) * up as it loads x, saving a launch and a pass over [T, I];
    otherwise the SwiGLU kernel then the GEMM, as unfused."""
    from ingot.plugins.activation.triton_kernels import make_swiglu

    params = tactic.as_dict() if tactic is not None else {}
    max_m = int(params.get("max_m", 0))
    swiglu = make_swiglu(None)
    linear = make_linear(tactic)

    def swiglu_linear(
        gate_up: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        *,
        add: AddOut | None = None,
    ) -> torch.Tensor:
        """gate_up: [T, 2I] (gate, then up), weight: [N, I] -> silu(gate) * up @ weight^T.
        add: added into the residual stream instead (fused_norm.py), which is returned."""
        out = add.residual if add is not None else None
        if max_m and gemv_ok(gate_up, weight, bias, out, max_m, gated=True):
            return launch_gemv(gate_up, weight, bias, None, params, True, add=add)
        return linear(swiglu(gate_up), weight, bias, add=add)

    swiglu_linear.gemv_rows = linear.gemv_rows
    return swiglu_linear


def make_embedding(tactic: Tactic | None = None):
    def embedding(
        ids: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """ids: [T] -> weight rows [T, D]."""
        if out is None:
            return F.embedding(ids.long() if ids.dtype != torch.long else ids, weight)
        return torch.index_select(weight, 0, ids, out=out)

    return embedding
