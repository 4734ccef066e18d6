"""EXPERIMENT, not an engine path yet: decode attention over an FP8 KV cache with both dots on
FP8 tensor cores, for large batches (one program per sequence x kv head, no context split).

Why: the decode kernel (triton_decode.py) converts every FP8 K and V element to fp16 before its
dots, and reads V for the second dot from shared memory a byte at a time; its loop issues ~3x
the instructions per byte of a BF16 cache's and reads the cache at 57-75% of the copy
bandwidth (H200, docs/performance.md 2026-12-03), against 86-100% for BF16. Triton runs an
FP8 dot on tensor cores only as a Hopper wgmma, whose M is at least 64, and a GQA group has 4
queries; so both dots are swapped ("S^T = K Q^T", "O^T = V^T P^T"): M is the key tile or the
head dim, N the group (padded to 16), and both operands are K-major as FP8 wgmma needs: K's
rows hold the head dim, and FP8 pools keep V transposed per block (tokens contiguous).

Precision: the cache's K and V are the MMAs' operands as stored (exact). The queries (each
row with its own scale, as the prefill's fp8_queries) and the probabilities P (in [0, 1], times
448) must be FP8 too. Rounded once (two_term=False) that costs ~3e-2 of the output, about the
FP8 cache's own error; the default splits each into two FP8 terms, hi + lo / 16 (fp8_pair),
two MMAs a dot, ~7 significant bits: near the decode kernel's fp16 dots (measured in
tests/test_quant_kernels_interp.py). A memory-bound decode leaves the tensor cores idle, so
the second MMA should cost little; the `batch` stage times both.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..quant.triton_quantize import to_fp8
from .layout import check_kv_layout
from .triton_prefill import LOG2E, fp8_query_scaled, out_values


@triton.jit
def fp8_pair(x):
    """x (fp32, within +-448) as hi + lo / 16 in two float8_e4m3fn: hi rounded, lo the rest
    (at most half of hi's ulp, so x 16 stays within 448) rounded in turn: ~7 significant bits
    instead of 4, at the cost of a second FP8 MMA."""
    hi = to_fp8(x)
    return hi, to_fp8((x - hi.to(tl.float32)) * 16.0)


@triton.jit
def _tile(q_hi, q_lo, qscale, m_i, l_i, acc, n0, ctx, bt_row, kc_ptr, vc_ptr, h, s_blk, s_tok,
          s_h, sv_blk, sv_h, BS: tl.constexpr, HD: tl.constexpr, BLOCK_N: tl.constexpr,
          MASKED: tl.constexpr, TWO_TERM: tl.constexpr):  # fmt: skip
    """Keys n0 .. n0 + BLOCK_N - 1 into the running softmax (m_i, l_i) and O^T (acc). MASKED:
    the context's last, partial tile (byte loads); whole tiles load 16-byte vectors.
    TWO_TERM: the queries and P as fp8_pair (two MMAs a dot), else rounded once (q_lo unused)."""
    n = n0 + tl.arange(0, BLOCK_N)
    d = tl.arange(0, HD)
    nm = n < ctx
    if MASKED:
        blk = tl.load(bt_row + n // BS, mask=nm, other=0).to(tl.int64)
    else:
        blk = tl.load(bt_row + n // BS).to(tl.int64)
    # each key's first byte in V^T: runs of BS contiguous keys (a block's), from multiples of
    # BS, so that the V^T tile's dim rows load as vectors
    kv = tl.max_contiguous(tl.multiple_of(blk * sv_blk + n % BS, BS), BS)
    k_ptrs = kc_ptr + (blk * s_blk + (n % BS) * s_tok + h * s_h)[:, None] + d[None, :]
    # V^T [HD, BLOCK_N]: each dim's tokens contiguous within a block (layout.py)
    v_ptrs = vc_ptr + kv[None, :] + (h * sv_h + d * BS)[:, None]
    if MASKED:
        k = tl.load(k_ptrs, mask=nm[:, None], other=0.0)
        vt = tl.load(v_ptrs, mask=nm[None, :], other=0.0)
    else:
        k = tl.load(k_ptrs)
        vt = tl.load(v_ptrs)
    s = tl.dot(k, tl.trans(q_hi))  # S^T [BLOCK_N, G_PAD]
    if TWO_TERM:
        s += tl.dot(k, tl.trans(q_lo)) * 0.0625
    s = s * qscale[None, :]  # log2 units
    if MASKED:
        s = tl.where(nm[:, None], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=0))
    p = tl.exp2(s - m_new[None, :])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, axis=0)
    if TWO_TERM:
        p_hi, p_lo = fp8_pair(p * 448.0)
        pv = tl.dot(vt, p_hi) + tl.dot(vt, p_lo) * 0.0625
    else:
        pv = tl.dot(vt, to_fp8(p * 448.0))
    return m_new, l_i, acc * alpha[None, :] + pv


@triton.jit
def _decode_fp8mma_kernel(q_ptr, kc_ptr, vc_ptr, ks_ptr, vs_ptr, bt_ptr, ctx_ptr, out_ptr,
                          os_ptr, scale_log2, G, sqt, sqh, sot, soh, s_blk, s_tok, s_h, sv_blk,
                          sv_h, s_bt, BS: tl.constexpr, HD: tl.constexpr, G_PAD: tl.constexpr,
                          BLOCK_N: tl.constexpr, QUANT_OUT: tl.constexpr,
                          TWO_TERM: tl.constexpr):  # fmt: skip
    b = tl.program_id(0)
    h = tl.program_id(1)
    ctx = tl.load(ctx_ptr + b)
    g = tl.arange(0, G_PAD)
    d = tl.arange(0, HD)
    gm = g < G
    q = tl.load(q_ptr + b.to(tl.int64) * sqt + (h * G + g)[:, None] * sqh + d[None, :],
                mask=gm[:, None], other=0.0)  # fmt: skip
    # q [G_PAD, HD] in FP8 and a softmax scale per query (its rounding scale and K's folded in)
    qs, qscale = fp8_query_scaled(q, scale_log2 * tl.load(ks_ptr))
    if TWO_TERM:
        q_hi, q_lo = fp8_pair(qs)
    else:
        q_hi = to_fp8(qs)
        q_lo = q_hi
    m_i = tl.full([G_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([HD, G_PAD], tl.float32)  # O^T
    bt_row = bt_ptr + b.to(tl.int64) * s_bt
    whole = ctx // BLOCK_N * BLOCK_N
    for n0 in range(0, whole, BLOCK_N):
        m_i, l_i, acc = _tile(q_hi, q_lo, qscale, m_i, l_i, acc, n0, ctx, bt_row, kc_ptr,
                              vc_ptr, h, s_blk, s_tok, s_h, sv_blk, sv_h, BS, HD, BLOCK_N,
                              False, TWO_TERM)  # fmt: skip
    if whole < ctx:
        m_i, l_i, acc = _tile(q_hi, q_lo, qscale, m_i, l_i, acc, whole, ctx, bt_row, kc_ptr,
                              vc_ptr, h, s_blk, s_tok, s_h, sv_blk, sv_h, BS, HD, BLOCK_N,
                              True, TWO_TERM)  # fmt: skip
    o = acc * (tl.load(vs_ptr) / (l_i * 448.0))[None, :]  # [HD, G_PAD]
    tl.store(out_ptr + b.to(tl.int64) * sot + (h * G + g)[None, :] * soh + d[:, None],
             out_values(o, q_ptr, out_ptr, os_ptr, QUANT_OUT), mask=gm[None, :])  # fmt: skip


def decode_fp8mma(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
    *,
    block_n: int = 64,
    num_warps: int = 4,
    num_stages: int = 2,
    two_term: bool = True,
    out: torch.Tensor | None = None,
    out_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """One query per sequence: q [B, Hq, hd] bf16/fp16 -> [B, Hq, hd] in q's dtype, over an
    FP8 cache whose V is transposed per block (layout.py), context_lens[b] keys each.
    out_scale: the output quantized to FP8 with it, as paged_attention's. two_term: queries
    and P in two FP8 terms each (fp8_pair; ~7 significant bits, twice the MMAs), else one."""
    B, hq, hd = q.shape
    hkv = k_cache.shape[2]
    if not check_kv_layout(k_cache, v_cache, "decode_fp8mma"):
        raise ValueError("decode_fp8mma: needs an FP8 pool's transposed V (layout.py)")
    if out is None:
        out = torch.empty_like(q, dtype=q.dtype if out_scale is None else torch.float8_e4m3fn)
    g = hq // hkv
    _decode_fp8mma_kernel[(B, hkv)](
        q, k_cache, v_cache, k_scale, v_scale, block_tables, context_lens, out, out_scale,
        float(scale) * LOG2E, g, q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0),
        v_cache.stride(2), block_tables.stride(0),
        BS=k_cache.shape[1], HD=hd, G_PAD=max(16, triton.next_power_of_2(g)), BLOCK_N=block_n,
        QUANT_OUT=out_scale is not None, TWO_TERM=two_term, num_warps=num_warps,
        num_stages=num_stages,
    )  # fmt: skip
    return out
