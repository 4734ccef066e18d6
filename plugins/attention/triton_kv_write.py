"""Paged KV-cache write in Triton; same contract as `reference.write_kv`.

One program per token copies its Hkv x hd keys and values into the flat slot
block * block_size + offset. Slots < 0 are skipped (padding tokens in a captured batch).
For the decoder's hot path prefer `rope.triton_kernels.make_rope_write_kv` (RoPE fused in).
FP8 KV cache: with k_scale / v_scale, k / k_scale and v / v_scale are stored saturated to
float8_e4m3fn (bit-exact with the reference); without them the kernel is the plain copy.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ..pdl import launch_options, pdl_begin
from ..quant.triton_quantize import quant_fp8
from ..registry import Tactic
from .layout import check_kv_layout

KV_WRITE_TACTICS: tuple[Tactic, ...] = (
    Tactic("w4", (("num_warps", 4),)),
    Tactic("w2", (("num_warps", 2),)),
    Tactic("w8", (("num_warps", 8),)),
)


@triton.jit
def _kv_write_kernel(
    k_ptr,
    v_ptr,
    kc_ptr,
    vc_ptr,
    slot_ptr,
    ks_ptr,
    vs_ptr,
    HKV,
    HD,
    skt,
    skh,
    svt,
    svh,
    sc_slot,
    sc_h,
    sv_blk,
    sv_tok,
    sv_h,
    sv_d,
    BS: tl.constexpr,
    KV_FP8: tl.constexpr,
    H_PAD: tl.constexpr,
    D_PAD: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl_begin(PDL)
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:
        h = tl.arange(0, H_PAD)[:, None]
        d = tl.arange(0, D_PAD)[None, :]
        m = (h < HKV) & (d < HD)
        k = tl.load(k_ptr + t * skt + h * skh + d, mask=m)
        v = tl.load(v_ptr + t * svt + h * svh + d, mask=m)
        dst = slot * sc_slot + h * sc_h + d
        # V has its own strides: FP8 pools store it transposed per block (layout.py)
        dst_v = (slot // BS) * sv_blk + (slot % BS) * sv_tok + h * sv_h + d * sv_d
        if KV_FP8:
            tl.store(kc_ptr + dst, quant_fp8(k.to(tl.float32), tl.load(ks_ptr)), mask=m)
            tl.store(vc_ptr + dst_v, quant_fp8(v.to(tl.float32), tl.load(vs_ptr)), mask=m)
        else:
            tl.store(kc_ptr + dst, k.to(kc_ptr.dtype.element_ty), mask=m)
            tl.store(vc_ptr + dst_v, v.to(vc_ptr.dtype.element_ty), mask=m)


# A prefill's V into a transposed (FP8) pool, layout.py: per-token stores put one byte into
# each of hd 32-byte sectors per token (H200: RoPE + KV write into an FP8 pool at 8,192 tokens,
# 168 us a layer, 27% of the copy bandwidth). Here a program stores whole windows: SEG slots of
# one block from a SEG boundary, each dim's SEG bytes at once. Calls of at least this many
# tokens go this way.
V_SEGMENT_MIN_TOKENS = 64


@triton.jit(do_not_specialize=["T", "v_rows"])
def _v_segments_kernel(
    v_ptr,
    vc_ptr,
    slot_ptr,
    vs_ptr,
    T,
    v_rows,
    svt,
    svh,
    sv_blk,
    sv_h,
    HD,
    BS: tl.constexpr,
    SEG: tl.constexpr,
    D_PAD: tl.constexpr,
    KV_FP8: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """Program (j, h) stores kv head h of the runs that start in rows j * SEG ... + SEG - 1: a
    run is rows whose slots are consecutive within one window (in an engine's step, a
    sequence's tokens in one window). A run need not start at a multiple of SEG: a chunk
    continuing mid-block, or any prompt packed after one whose length is not a multiple of SEG
    (most of a mixed step's rows), so its rows are found from its slots, not from the grid."""
    pdl_begin(PDL)
    j = tl.program_id(0)
    h = tl.program_id(1)
    n = tl.minimum(T, v_rows)
    i = tl.arange(0, SEG)
    t = j * SEG + i
    tm = t < n
    s = tl.load(slot_ptr + t, mask=tm, other=-1)
    prev = tl.load(slot_ptr + t - 1, mask=tm & (t > 0), other=-1)
    # a run: rows of consecutive slots in one window (slots < 0, padding, in none)
    starts = (s >= 0) & ((prev != s - 1) | (s % SEG == 0))
    d = tl.arange(0, D_PAD)
    dm = d < HD
    t0 = j * SEG - 1
    for _ in range(tl.sum(starts.to(tl.int32))):
        t0 = tl.min(tl.where(starts & (t > t0), t, n))  # the next run's first row
        s0 = tl.sum(tl.where(t == t0, s, 0))
        w0 = s0 - s0 % SEG  # the window's first slot; row t0 + k holds slot s0 + k
        r = t0 - s0 % SEG + i  # the row of slot w0 + i, where the step has it
        rm = (r >= t0) & (r < n)
        ok = rm & (tl.load(slot_ptr + r, mask=rm, other=-1) == w0 + i)
        v = tl.load(v_ptr + r.to(tl.int64)[:, None] * svt + h * svh + d[None, :],
                    mask=ok[:, None] & dm[None, :], other=0.0)  # fmt: skip
        if KV_FP8:
            v = quant_fp8(v.to(tl.float32), tl.load(vs_ptr))
        vt = tl.trans(v.to(vc_ptr.dtype.element_ty))  # [D_PAD, SEG]: tokens along each dim's row
        # NOTE: hints as load_v's: each dim's SEG tokens contiguous from a SEG boundary
        c = tl.max_contiguous(tl.multiple_of(w0 % BS + i, SEG), SEG)
        ptr = vc_ptr + (w0 // BS).to(tl.int64) * sv_blk + h * sv_h + d[:, None] * BS + c[None, :]
        if tl.sum(ok.to(tl.int32)) == SEG:  # whole: SEG bytes a dim in one store
            tl.store(ptr, vt, mask=dm[:, None])
        else:  # a chunk's first or last window (or scattered slots): the run's tokens only
            tl.store(ptr, vt, mask=dm[:, None] & ok[None, :])


def write_v_segments(v, v_cache, slot_mapping, v_scale=None, v_rows=None) -> None:
    """V [T, Hkv, hd] (its first v_rows tokens; None: all) into a transposed V cache
    (layout.py) at slot_mapping, as the per-token kernels store it (the same bytes), a
    segment of tokens at a time. v_scale: an FP8 cache's (float32 [])."""
    T, hkv, hd = v.shape
    bs = v_cache.shape[1]
    seg = math.gcd(bs, 32)
    if T == 0:
        return
    _v_segments_kernel[(triton.cdiv(T, seg), hkv)](
        v, v_cache, slot_mapping, v_scale, T, T if v_rows is None else int(v_rows),
        v.stride(0), v.stride(1), v_cache.stride(0), v_cache.stride(2), hd,
        BS=bs, SEG=seg, D_PAD=triton.next_power_of_2(hd), KV_FP8=v_scale is not None,
        num_warps=4, **launch_options(),
    )  # fmt: skip


def make_write_kv(tactic: Tactic | None = None):
    params = (tactic or KV_WRITE_TACTICS[0]).as_dict()

    def write_kv(
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        *,
        k_scale: torch.Tensor | None = None,
        v_scale: torch.Tensor | None = None,
    ) -> None:
        """Scatter k, v: [T, Hkv, hd] into caches [num_blocks, block_size, Hkv, hd] at slots [T]
        (V in either layout of layout.py).

        k_scale / v_scale (float32 [], FP8 KV cache, float8_e4m3fn caches): store k / k_scale
        and v / v_scale saturated to fp8. None: store k, v cast to the cache dtype.
        """
        fp8 = k_scale is not None and v_scale is not None
        if fp8 and k_cache.dtype != torch.float8_e4m3fn:
            raise ValueError(
                f"write_kv: k_scale/v_scale need a float8_e4m3fn cache, got {k_cache.dtype}"
            )
        T, hkv, hd = k.shape
        if k.stride(-1) != 1 or v.stride(-1) != 1:
            raise ValueError("write_kv: the last (head_dim) dimension must be contiguous")
        check_kv_layout(k_cache, v_cache, "write_kv")
        if T == 0:
            return
        _kv_write_kernel[(T,)](
            k,
            v,
            k_cache,
            v_cache,
            slot_mapping,
            k_scale if fp8 else None,
            v_scale if fp8 else None,
            hkv,
            hd,
            k.stride(0),
            k.stride(1),
            v.stride(0),
            v.stride(1),
            k_cache.stride(1),
            k_cache.stride(2),
            *v_cache.stride(),
            BS=k_cache.shape[1],
            KV_FP8=fp8,
            H_PAD=triton.next_power_of_2(hkv),
            D_PAD=triton.next_power_of_2(hd),
            num_warps=int(params.get("num_warps", 4)),
            **launch_options(),
        )

    return write_kv
