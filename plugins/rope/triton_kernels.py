"""RoPE (rotate-half layout) in Triton, applying the reference's precomputed cos/sin cache.

`make_rope` has the reference's contract (returns new rotated q, k). `make_rope_write_kv` is the
fused decoder step: rotate q and k, scatter the rotated k and the plain v into the paged cache
(as `attention.reference.write_kv` would), and return the rotated q — one launch instead of two.
Both accept q/k/v as strided views of a fused QKV projection (last dim contiguous). With
`v_rows`, V is written for the first v_rows tokens only: the rest is the decode rows' V, left to
the decode attention kernel (`paged_attention(new_v=)`; the Decoder's decode_writes_v, off).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..attention.layout import check_kv_layout, is_transposed
from ..attention.triton_kv_write import V_SEGMENT_MIN_TOKENS, write_v_segments
from ..pdl import launch_options, pdl_begin
from ..quant.triton_quantize import quant_fp8
from ..registry import Tactic

ROPE_TACTICS: tuple[Tactic, ...] = (
    Tactic("w4", (("num_warps", 4),)),
    Tactic("w2", (("num_warps", 2),)),
    Tactic("w8", (("num_warps", 8),)),
)


@triton.jit
def _rotate_heads(
    x_ptr,
    o_ptr,
    cache_ptr,
    slot,
    t,
    H,
    HALF,
    sxt,
    sxh,
    sot,
    soh,
    sc_slot,
    sc_h,
    c1,
    c2,
    s1,
    s2,
    cache_scale,
    WRITE_OUT: tl.constexpr,
    WRITE_CACHE: tl.constexpr,
    KV_FP8: tl.constexpr,
    H_PAD: tl.constexpr,
    HALF_PAD: tl.constexpr,
):
    h = tl.arange(0, H_PAD)[:, None]
    d = tl.arange(0, HALF_PAD)[None, :]
    m = (h < H) & (d < HALF)
    base = x_ptr + t * sxt + h * sxh + d
    x1 = tl.load(base, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(base + HALF, mask=m, other=0.0).to(tl.float32)
    y1 = x1 * c1 - x2 * s1
    y2 = x2 * c2 + x1 * s2
    if WRITE_OUT:
        ob = o_ptr + t * sot + h * soh + d
        tl.store(ob, y1.to(o_ptr.dtype.element_ty), mask=m)
        tl.store(ob + HALF, y2.to(o_ptr.dtype.element_ty), mask=m)
    if WRITE_CACHE:
        if slot >= 0:
            cb = cache_ptr + slot * sc_slot + h * sc_h + d
            if KV_FP8:  # as RoPE then the FP8 KV write: k rounded to its dtype, then quantized
                dt = x_ptr.dtype.element_ty
                tl.store(cb, quant_fp8(y1.to(dt).to(tl.float32), cache_scale), mask=m)
                tl.store(cb + HALF, quant_fp8(y2.to(dt).to(tl.float32), cache_scale), mask=m)
            else:
                tl.store(cb, y1.to(cache_ptr.dtype.element_ty), mask=m)
                tl.store(cb + HALF, y2.to(cache_ptr.dtype.element_ty), mask=m)


# NOTE: v_from / v_rows are not specialized: one binary whether a step writes every V, none
# (decode graphs; a prefill's, written a segment at a time) or some (mixed steps)
@triton.jit(do_not_specialize=["v_from", "v_rows"])
def _rope_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    pos_ptr,
    cos_ptr,
    sin_ptr,
    qo_ptr,
    ko_ptr,
    kc_ptr,
    vc_ptr,
    slot_ptr,
    ks_ptr,
    vs_ptr,
    HQ,
    HKV,
    HALF,
    sqt,
    sqh,
    skt,
    skh,
    svt,
    svh,
    sqot,
    sqoh,
    skot,
    skoh,
    s_cos,
    sc_slot,
    sc_h,
    sv_blk,
    sv_tok,
    sv_h,
    sv_d,
    v_from,
    v_rows,
    BS: tl.constexpr,
    WRITE_K_OUT: tl.constexpr,
    WRITE_CACHE: tl.constexpr,
    KV_FP8: tl.constexpr,
    HQ_PAD: tl.constexpr,
    HKV_PAD: tl.constexpr,
    HALF_PAD: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl_begin(PDL)
    t = tl.program_id(0)
    p = tl.load(pos_ptr + t).to(tl.int64)
    d = tl.arange(0, HALF_PAD)[None, :]
    dm = d < HALF
    c1 = tl.load(cos_ptr + p * s_cos + d, mask=dm, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + p * s_cos + HALF + d, mask=dm, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + p * s_cos + d, mask=dm, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + p * s_cos + HALF + d, mask=dm, other=0.0).to(tl.float32)
    slot = -1
    k_scale = 1.0
    if WRITE_CACHE:
        slot = tl.load(slot_ptr + t).to(tl.int64)
        if KV_FP8:
            k_scale = tl.load(ks_ptr)
    _rotate_heads(
        q_ptr,
        qo_ptr,
        kc_ptr,
        slot,
        t,
        HQ,
        HALF,
        sqt,
        sqh,
        sqot,
        sqoh,
        sc_slot,
        sc_h,
        c1,
        c2,
        s1,
        s2,
        1.0,
        True,
        False,
        False,
        HQ_PAD,
        HALF_PAD,
    )
    _rotate_heads(
        k_ptr,
        ko_ptr,
        kc_ptr,
        slot,
        t,
        HKV,
        HALF,
        skt,
        skh,
        skot,
        skoh,
        sc_slot,
        sc_h,
        c1,
        c2,
        s1,
        s2,
        k_scale,
        WRITE_K_OUT,
        WRITE_CACHE,
        KV_FP8,
        HKV_PAD,
        HALF_PAD,
    )
    if WRITE_CACHE:
        if (slot >= 0) & (t >= v_from) & (t < v_rows):
            h = tl.arange(0, HKV_PAD)[:, None]
            dd = tl.arange(0, 2 * HALF_PAD)[None, :]
            m = (h < HKV) & (dd < 2 * HALF)
            v = tl.load(v_ptr + t * svt + h * svh + dd, mask=m)
            if KV_FP8:
                v = quant_fp8(v.to(tl.float32), tl.load(vs_ptr))
            # V has its own strides: FP8 pools store it transposed per block (layout.py)
            dst = (slot // BS) * sv_blk + (slot % BS) * sv_tok + h * sv_h + dd * sv_d
            tl.store(vc_ptr + dst, v.to(vc_ptr.dtype.element_ty), mask=m)


def _check_last_dim(*ts: torch.Tensor) -> None:
    for t in ts:
        if t.stride(-1) != 1:
            raise ValueError("rope: the last (head_dim) dimension must be contiguous")


def _launch(
    q, k, v, positions, cos, sin, q_out, k_out, k_cache, v_cache, slots, params, scales=None,
    v_rows=None, v_from=0,
):  # fmt: skip
    """scales: (k_scale, v_scale) of an FP8 KV cache (float32 []), or None. V is written for
    tokens v_from .. v_rows - 1 only (v_rows None: to the last)."""
    T, hq, hd = q.shape
    hkv = k.shape[1]
    if hd % 2:
        raise ValueError(f"rope: head_dim {hd} must be even")
    if cos.stride(-1) != 1 or sin.stride() != cos.stride():
        raise ValueError("rope: cos/sin must be contiguous rows of the same layout")
    if T == 0:
        return
    half = hd // 2
    write_cache = k_cache is not None
    if write_cache:
        check_kv_layout(k_cache, v_cache, "rope_write_kv")
    _rope_kernel[(T,)](
        q,
        k,
        v if v is not None else k,
        positions,
        cos,
        sin,
        q_out,
        k_out if k_out is not None else q_out,
        k_cache if write_cache else q_out,
        v_cache if write_cache else q_out,
        slots if write_cache else positions,
        scales[0] if scales is not None else None,
        scales[1] if scales is not None else None,
        hq,
        hkv,
        half,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0) if v is not None else 0,
        v.stride(1) if v is not None else 0,
        q_out.stride(0),
        q_out.stride(1),
        k_out.stride(0) if k_out is not None else 0,
        k_out.stride(1) if k_out is not None else 0,
        cos.stride(0),
        k_cache.stride(1) if write_cache else 0,
        k_cache.stride(2) if write_cache else 0,
        *(v_cache.stride() if write_cache else (0, 0, 0, 0)),
        int(v_from),
        T if v_rows is None else int(v_rows),
        BS=k_cache.shape[1] if write_cache else 1,
        WRITE_K_OUT=k_out is not None,
        WRITE_CACHE=write_cache,
        KV_FP8=scales is not None,
        HQ_PAD=triton.next_power_of_2(hq),
        HKV_PAD=triton.next_power_of_2(hkv),
        HALF_PAD=triton.next_power_of_2(half),
        num_warps=int(params.get("num_warps", 4)),
        **launch_options(),
    )


def make_rope(tactic: Tactic | None = None):
    params = (tactic or ROPE_TACTICS[0]).as_dict()

    def apply_rope(
        q: torch.Tensor,
        k: torch.Tensor,
        positions: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        q_out: torch.Tensor | None = None,
        k_out: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [T, Hq, hd], k: [T, Hkv, hd], positions: [T]; cos, sin: [max_pos, hd] float32.
        Returns rotated (q, k) in their dtypes. q_out / k_out may alias q / k (in place)."""
        _check_last_dim(q, k)
        q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device) if q_out is None else q_out
        k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device) if k_out is None else k_out
        _launch(q, k, None, positions, cos, sin, q_out, k_out, None, None, None, params)
        return q_out, k_out

    return apply_rope


def make_rope_write_kv(tactic: Tactic | None = None):
    params = (tactic or ROPE_TACTICS[0]).as_dict()

    def rope_write_kv(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        positions: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        q_out: torch.Tensor | None = None,
        *,
        k_scale: torch.Tensor | None = None,
        v_scale: torch.Tensor | None = None,
        v_rows: int | None = None,
        runs: int = 0,
    ) -> torch.Tensor:
        """Equivalent to `q, k = apply_rope(q, k, ...)` then `write_kv(k, v, caches, slots,
        k_scale=, v_scale=)` (scales: an FP8 KV cache's); returns the rotated q [T, Hq, hd].
        Slots < 0 are skipped (padding tokens). v_rows: only the first v_rows tokens' V is
        written (the rest is the decode rows' V, which paged_attention stores: new_v).
        runs: the first `runs` tokens are prompt tokens, their slots mostly in order (a hint:
        into a transposed V they are written a segment at a time; the same bytes)."""
        _check_last_dim(q, k, v)
        q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device) if q_out is None else q_out
        scales = (k_scale, v_scale) if k_scale is not None and v_scale is not None else None
        T = q.shape[0]
        runs = min(int(runs), T if v_rows is None else int(v_rows))
        if runs < V_SEGMENT_MIN_TOKENS or not is_transposed(v_cache):
            runs = 0
        _launch(
            q, k, v, positions, cos, sin, q_out, None, k_cache, v_cache, slot_mapping, params,
            scales, v_rows, runs,
        )  # fmt: skip
        if runs:  # the prompt tokens' V into the transposed pool, a segment at a time
            write_v_segments(v, v_cache, slot_mapping, scales[1] if scales else None, runs)
        return q_out

    return rope_write_kv
