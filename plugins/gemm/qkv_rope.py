"""The QKV projection with RoPE and the KV-cache write in its epilogue (decode-sized batches).

At batch 1 a decode layer ran the QKV GEMV, then the RoPE + KV-write kernel (2.2 us of GPU
time per layer on the H200, 71 us per step), then attention. Here the GEMV's programs own
weight rows in RoPE pairs instead of consecutive rows: a program of BLOCK_N rows takes dims
j .. j + BLOCK_N/2 - 1 of one head and the same dims + head_dim/2 (rotate-half pairs them),
so its epilogue holds both halves of every pair it rotates. q heads are rotated into q_out,
k heads rotated into the paged K cache, v heads stored into the V cache; the [T, qkv] tensor
the unfused path writes and the RoPE kernel reads back is never written.

Bits: the sum is rounded to the model dtype first (the GEMM's output), then rotated in fp32
with the same cos/sin rows and quantized (an FP8 cache) exactly as `_rope_kernel` does, so the
result equals the GEMV then the RoPE kernel. Batches past the tactic's max_m, non-pair-aligned
head dims, cuBLAS tactics and FP8 weights take the unfused path (the same two plugins).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..attention.layout import check_kv_layout
from ..quant.cuda_fp8 import FP8_GEMM_TACTICS
from ..quant.triton_quantize import quant_fp8
from ..registry import Tactic
from ..rope.triton_kernels import make_rope_write_kv
from .cuda import (
    GEMM_TACTICS,
    gemv_acc,
    gemv_epilogue_inputs,
    gemv_ok,
    gemv_pdl_options,
    make_linear,
    norm_args,
)
from .fused_norm import NormIn, normed_input
from .reference import unfused_qkv_rope

# the GEMV tactics (the first is the cross-build default, as for the gemm plugin); the builder
# takes the one it timed fastest for the attn.qkv GEMM (the epilogue is a few stores)
QKV_ROPE_TACTICS: tuple[Tactic, ...] = tuple(
    t for t in GEMM_TACTICS if t.as_dict().get("max_m", 0) > 0
)
# FP8 weights: the FP8 GEMM's GEMV tactics (16 fp8 a load); the builder takes the attn.qkv
# fp8_gemm choice when it is one of them
FP8_QKV_ROPE_TACTICS: tuple[Tactic, ...] = tuple(
    t for t in FP8_GEMM_TACTICS if t.as_dict().get("max_m", 0) > 0
)


@triton.jit
def _store_cache(ptr, y, slot, hkv, d, s_slot_blk, s_tok, s_h, s_d, scale, ok,
                 BS: tl.constexpr, KV_FP8: tl.constexpr, dt: tl.constexpr):  # fmt: skip
    """y [BLOCK_M, HB] (fp32, already rounded to dt) at dims d of kv head hkv, token slots
    `slot` [BLOCK_M] (rows where `ok`); strides: block, token in block, head, dim."""
    dst = (slot // BS)[:, None] * s_slot_blk + (slot % BS)[:, None] * s_tok + hkv * s_h
    ptrs = ptr + dst + d[None, :] * s_d
    if KV_FP8:
        tl.store(ptrs, quant_fp8(y.to(dt).to(tl.float32), scale), mask=ok[:, None])
    else:
        tl.store(ptrs, y.to(ptr.dtype.element_ty), mask=ok[:, None])


@triton.jit
def rope_pair_rows(HALF: tl.constexpr, BLOCK_N: tl.constexpr):
    """This program's head h, its dims d = j0 .. j0 + BLOCK_N/2 - 1 and its weight rows rn:
    dims d of head h, then d + HALF (the rotate-half pairs). Grid: heads x HALF / (BLOCK_N/2)."""
    HB: tl.constexpr = BLOCK_N // 2
    PER_HEAD: tl.constexpr = HALF // HB
    pid = tl.program_id(0)
    h = pid // PER_HEAD
    j0 = (pid % PER_HEAD) * HB
    i = tl.arange(0, BLOCK_N)
    rn = h * (2 * HALF) + j0 + i % HB + (i // HB) * HALF
    return h, j0 + tl.arange(0, HB), rn


@triton.jit
def rope_inputs(pos_ptr, cos_ptr, sin_ptr, slot_ptr, ks_ptr, vs_ptr, rm_c, mm, d, s_cos,
                HALF: tl.constexpr, KV_FP8: tl.constexpr):  # fmt: skip
    """What the epilogue reads for x's rows rm_c (in range mm) and dims d: the cos / sin of
    both halves, the token slots (ok: rows that are written), the FP8 cache's scales.
    Loaded before the weight stream, which hides their latency (after the loop, two dependent
    round trips cost ~1.2 us per call on the H200). PDL: these are step inputs, written before
    the pass's first PDL kernel, so they may be read before the wait (plugins/pdl.py)."""
    p = tl.load(pos_ptr + rm_c).to(tl.int64)[:, None] * s_cos
    c1 = tl.load(cos_ptr + p + d[None, :])
    c2 = tl.load(cos_ptr + p + HALF + d[None, :])
    s1 = tl.load(sin_ptr + p + d[None, :])
    s2 = tl.load(sin_ptr + p + HALF + d[None, :])
    slot = tl.load(slot_ptr + rm_c).to(tl.int64)
    ok = mm & (slot >= 0)
    ks = 1.0
    vs = 1.0
    if KV_FP8:
        ks = tl.load(ks_ptr)
        vs = tl.load(vs_ptr)
    return c1, c2, s1, s2, slot, ok, ks, vs


@triton.jit
def rope_epilogue(y, h, d, rm, mm, c1, c2, s1, s2, slot, ok, ks, vs, q_ptr, kc_ptr, vc_ptr,
                  sqt, sqh, sk_blk, sk_tok, sk_h, sv_blk, sv_tok, sv_h, sv_d, HQ, HKV,
                  HALF: tl.constexpr, BS: tl.constexpr, KV_FP8: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):  # fmt: skip
    """y [BLOCK_M, BLOCK_N]: the fp32 sums (bias added) of rows `rope_pair_rows` gave, rounded
    to q's dtype (the GEMM's output, as the RoPE kernel would read it), then: q heads rotated
    into q, k heads rotated into the K cache, v heads stored into the V cache (its own layout:
    FP8 pools transpose it), as `rope.triton_kernels._rope_kernel` would."""
    HB: tl.constexpr = BLOCK_N // 2
    dt = q_ptr.dtype.element_ty
    y = y.to(dt).to(tl.float32)
    x1, x2 = tl.split(tl.permute(tl.reshape(y, [BLOCK_M, 2, HB]), (0, 2, 1)))
    if h < HQ + HKV:  # q or k: rotate
        y1 = x1 * c1 - x2 * s1
        y2 = x2 * c2 + x1 * s2
        if h < HQ:
            qp = q_ptr + rm[:, None] * sqt + h * sqh + d[None, :]
            tl.store(qp, y1.to(dt), mask=mm[:, None])
            tl.store(qp + HALF, y2.to(dt), mask=mm[:, None])
        else:
            hk = h - HQ
            _store_cache(kc_ptr, y1, slot, hk, d, sk_blk, sk_tok, sk_h, 1, ks, ok, BS, KV_FP8, dt)
            _store_cache(kc_ptr, y2, slot, hk, d + HALF, sk_blk, sk_tok, sk_h, 1, ks, ok, BS,
                         KV_FP8, dt)  # fmt: skip
    else:
        hv = h - HQ - HKV
        _store_cache(vc_ptr, x1, slot, hv, d, sv_blk, sv_tok, sv_h, sv_d, vs, ok, BS, KV_FP8, dt)
        _store_cache(vc_ptr, x2, slot, hv, d + HALF, sv_blk, sv_tok, sv_h, sv_d, vs, ok, BS,
                     KV_FP8, dt)  # fmt: skip


@triton.jit
def _qkv_rope_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    pos_ptr,
    cos_ptr,
    sin_ptr,
    q_ptr,
    kc_ptr,
    vc_ptr,
    slot_ptr,
    ks_ptr,
    vs_ptr,
    sx_ptr,
    sw_ptr,
    T,
    K_v,
    sxm_v,
    swn_v,
    sqt,
    sqh,
    s_cos,
    sk_blk,
    sk_tok,
    sk_h,
    sv_blk,
    sv_tok,
    sv_h,
    sv_d,
    HQ,
    HKV,
    HALF: tl.constexpr,
    BS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    KV_FP8: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    VEC: tl.constexpr,
    STAGES: tl.constexpr,
    UNROLL: tl.constexpr,
    PDL: tl.constexpr = False,
    PRE: tl.constexpr = 1,
    NORM: tl.constexpr = False,
    wn_ptr=None,
    ss_ptr=None,
    sss=0,
    eps=0.0,
    SCALED: tl.constexpr = False,
    QUANT_X: tl.constexpr = False,
):
    """Grid: (HQ + 2 HKV) heads x HALF / (BLOCK_N / 2) programs; every row index is valid.
    NORM: x is the residual stream, RMSNorm-ed as loaded (`gemv_acc`, fused_norm.py).
    SCALED: FP8 weights and x with per-tensor scales at sw_ptr / sx_ptr, as the FP8 GEMV
    (`cuda._gemv_kernel`); QUANT_X: x arrives in the model dtype (NORM) and is quantized with
    sx as it is loaded. The output rounds to q's dtype (the model's)."""
    h, d, rn = rope_pair_rows(HALF, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    mm = rm < T
    rm_c = tl.where(mm, rm, 0)
    c1, c2, s1, s2, slot, ok, ks, vs = rope_inputs(pos_ptr, cos_ptr, sin_ptr, slot_ptr, ks_ptr,
                                                   vs_ptr, rm_c, mm, d, s_cos, HALF, KV_FP8)  # fmt: skip
    # as the FP8 GEMV: the exact fp32 sum times both scales, then the bias (read up front)
    sx, sxw, bias = gemv_epilogue_inputs(sx_ptr, sw_ptr, b_ptr, rn, SCALED, HAS_BIAS, BLOCK_N)
    y = gemv_acc(
        x_ptr, w_ptr, rn, T, K_v * VEC, sxm_v * VEC, swn_v * VEC, sx,
        BLOCK_M, BLOCK_N, BLOCK_K, VEC, STAGES, UNROLL, False, PDL, QUANT_X, PRE,
        NORM, wn_ptr, ss_ptr, sss, eps,
    )  # fmt: skip
    if SCALED:
        y = y * sxw
    if HAS_BIAS:
        y += bias[None, :]
    rope_epilogue(y, h, d, rm, mm, c1, c2, s1, s2, slot, ok, ks, vs, q_ptr, kc_ptr, vc_ptr,
                  sqt, sqh, sk_blk, sk_tok, sk_h, sv_blk, sv_tok, sv_h, sv_d, HQ, HKV,
                  HALF, BS, KV_FP8, BLOCK_M, BLOCK_N)  # fmt: skip


def fusable(x, weight, bias, num_heads, num_kv_heads, params, norm=None, out_dtype=None) -> bool:
    """Whether the fused kernel takes this call (else the GEMM then the RoPE + KV write).
    FP8 weights: x FP8 (quantized before) or the residual stream with `norm`; out_dtype, the
    model dtype, is then q's."""
    max_m = int(params.get("max_m", 0))
    heads = num_heads + 2 * num_kv_heads
    out_dtype = out_dtype or x.dtype
    if not max_m or weight.shape[0] % heads or out_dtype not in (torch.bfloat16, torch.float16):
        return False
    half = weight.shape[0] // heads // 2
    hb = int(params["block_n"]) // 2
    return (
        (weight.dtype == x.dtype or weight.dtype == torch.float8_e4m3fn)
        and hb > 0
        and half % hb == 0
        and gemv_ok(x, weight, bias, None, max_m, out_dtype=out_dtype, norm=norm)
    )


def rope_output(
    x, rows: int, num_heads, num_kv_heads, cos, sin, k_cache, v_cache, dtype, name: str
) -> tuple[torch.Tensor, int, tuple]:
    """What a QKV-RoPE kernel's launch needs beside its GEMV's: (q [T, Hq, hd] to write, hd,
    the epilogue's strides and head counts in the kernels' order: q's token and head, cos's
    row, the K cache's block, token and head, the V cache's four); checks cos / sin and the
    caches' layout. rows: the projection's output rows, (Hq + 2 Hkv) hd."""
    if cos.stride(-1) != 1 or sin.stride() != cos.stride():
        raise ValueError(f"{name}: cos/sin must be contiguous rows of the same layout")
    check_kv_layout(k_cache, v_cache, name)
    hd = rows // (num_heads + 2 * num_kv_heads)
    q = torch.empty((x.shape[0], num_heads, hd), dtype=dtype, device=x.device)
    strides = (q.stride(0), q.stride(1), cos.stride(0), *k_cache.stride()[:3], *v_cache.stride(),
               num_heads, num_kv_heads)  # fmt: skip
    return q, hd, strides


def _launch(x, weight, bias, positions, cos, sin, k_cache, v_cache, slot_mapping, num_heads,
            num_kv_heads, params, k_scale, v_scale, norm, scales=None, out_dtype=None):  # fmt: skip
    """The fused kernel (`fusable` holds). scales: FP8 weights' (input scale, weight scale)."""
    T = x.shape[0]
    q, hd, strides = rope_output(x, weight.shape[0], num_heads, num_kv_heads, cos, sin, k_cache,
                                 v_cache, out_dtype or x.dtype, "qkv_rope")  # fmt: skip
    if T == 0:
        return q
    vec = 16 // weight.element_size()
    bn = int(params["block_n"])
    fp8 = k_scale is not None and v_scale is not None
    sx, sw = scales if scales is not None else (None, None)
    grid = ((num_heads + 2 * num_kv_heads) * (hd // bn),)
    _qkv_rope_kernel[grid](
        x, weight, bias if bias is not None else weight, positions, cos, sin, q,
        k_cache, v_cache, slot_mapping,
        k_scale if fp8 else None, v_scale if fp8 else None, sx, sw,
        T, weight.shape[1] // vec, x.stride(0) // vec, weight.stride(0) // vec, *strides,
        HALF=hd // 2,
        BS=k_cache.shape[1],
        HAS_BIAS=bias is not None,
        KV_FP8=fp8,
        BLOCK_M=triton.next_power_of_2(T),
        BLOCK_N=bn,
        BLOCK_K=int(params["block_k"]),
        VEC=vec,
        STAGES=int(params.get("num_stages", 1)),
        UNROLL=int(params.get("unroll", 1)),
        num_warps=int(params["num_warps"]),
        num_stages=1,
        **gemv_pdl_options(weight.shape[1], weight.element_size(), params),
        **norm_args(norm),
        **(dict(SCALED=True, QUANT_X=x.dtype != weight.dtype) if scales is not None else {}),
    )  # fmt: skip
    return q


def make_qkv_rope_linear(tactic: Tactic | None = None):
    params = (tactic or QKV_ROPE_TACTICS[0]).as_dict()
    linear = make_linear(tactic or QKV_ROPE_TACTICS[0])
    rope_write_kv = make_rope_write_kv(None)

    def qkv_rope_linear(
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        positions: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        num_heads: int,
        num_kv_heads: int,
        *,
        k_scale: torch.Tensor | None = None,
        v_scale: torch.Tensor | None = None,
        norm: NormIn | None = None,
    ) -> torch.Tensor:
        """`reference.qkv_rope_linear`'s contract: x [T, K] -> the rotated q [T, Hq, hd]; the
        rotated k and v are written into the caches at slot_mapping (slots < 0 skipped).
        norm: x is the residual stream, RMSNorm-ed as it is loaded (fused_norm.py)."""
        if not fusable(x, weight, bias, num_heads, num_kv_heads, params, norm):
            return unfused_qkv_rope(
                linear, rope_write_kv, normed_input(x, norm) if norm is not None else x,
                weight, bias, positions, cos, sin, k_cache, v_cache, slot_mapping, num_heads,
                num_kv_heads, k_scale=k_scale, v_scale=v_scale,
            )  # fmt: skip
        return _launch(x, weight, bias, positions, cos, sin, k_cache, v_cache, slot_mapping,
                       num_heads, num_kv_heads, params, k_scale, v_scale, norm)  # fmt: skip

    qkv_rope_linear.gemv_rows = linear.gemv_rows
    return qkv_rope_linear


def make_fp8_qkv_rope_linear(tactic: Tactic | None = None):
    """The FP8 (W8A8) QKV projection with RoPE and the KV write in its epilogue: the FP8 GEMV
    of `quant/cuda_fp8.py` (its tactics), the epilogue above. Calls the kernel does not take
    run the FP8 GEMM plugin, then the RoPE + KV-write kernel."""
    from ..quant.cuda_fp8 import make_fp8_linear

    params = (tactic or FP8_QKV_ROPE_TACTICS[0]).as_dict()
    fp8_linear = make_fp8_linear(tactic or FP8_QKV_ROPE_TACTICS[0])
    rope_write_kv = make_rope_write_kv(None)

    def fp8_qkv_rope_linear(
        x: torch.Tensor,
        weight: torch.Tensor,
        weight_scale: torch.Tensor,
        input_scale: torch.Tensor,
        bias: torch.Tensor | None,
        positions: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        num_heads: int,
        num_kv_heads: int,
        *,
        out_dtype: torch.dtype | None = None,
        k_scale: torch.Tensor | None = None,
        v_scale: torch.Tensor | None = None,
        norm: NormIn | None = None,
    ) -> torch.Tensor:
        """`quant.reference.fp8_qkv_rope_linear`'s contract: x [T, K] (FP8, quantized with
        input_scale, or the model dtype) -> the rotated q [T, Hq, hd] in out_dtype (x's dtype
        if not given); k and v written into the caches. norm: x is the residual stream,
        RMSNorm-ed, then quantized, as it is loaded."""
        out_dtype = out_dtype or x.dtype
        if not fusable(x, weight, bias, num_heads, num_kv_heads, params, norm, out_dtype):
            nk = {"norm": norm} if norm is not None else {}

            def linear(x, weight, bias):
                return fp8_linear(x, weight, weight_scale, input_scale, bias,
                                  out_dtype=out_dtype, **nk)  # fmt: skip

            return unfused_qkv_rope(
                linear, rope_write_kv, x, weight, bias, positions, cos, sin, k_cache, v_cache,
                slot_mapping, num_heads, num_kv_heads, k_scale=k_scale, v_scale=v_scale,
            )  # fmt: skip
        return _launch(x, weight, bias, positions, cos, sin, k_cache, v_cache, slot_mapping,
                       num_heads, num_kv_heads, params, k_scale, v_scale, norm,
                       (input_scale, weight_scale), out_dtype)  # fmt: skip

    fp8_qkv_rope_linear.gemv_rows = fp8_linear.gemv_rows
    return fp8_qkv_rope_linear
