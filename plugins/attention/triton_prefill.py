"""Paged causal attention for prefill (and chunked prefill / prefix reuse) in Triton.

Semantics are `reference.paged_attention`'s: sequence b's queries are rows
query_start_loc[b]:query_start_loc[b+1] of the packed q and sit at the LAST q_len positions of its
context, whose keys and values (cached prefix included) are already in the paged cache.

Grid (query tile, q head, sequence): one program runs a FlashAttention-2 style online softmax for
BLOCK_M queries of one head over the keys it may see (causal, optionally a sliding window),
gathering K/V rows through the block table; only the key tiles on the causal diagonal are
masked. Tiles past a sequence's q_len exit at once, so the grid is sized by max_query_len,
never by tensor values. Tactics with `gqa` pack the G q heads of one kv head into a tile
(grid (query tile, kv head, sequence)), so K/V tiles are loaded once per group.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..pdl import launch_options, pdl_begin
from ..quant.triton_quantize import quant_fp8, to_fp8
from ..registry import Tactic
from .layout import check_kv_layout


def read_ahead(tactic: Tactic) -> Tactic:
    """`tactic` with each key tile's block-table entry read a tile ahead (BT_AHEAD; the decode
    and prefill kernels both take it)."""
    return Tactic(tactic.name + "_a", (*tactic.params, ("bt_ahead", 1)))


_M64_N64_S3 = Tactic(
    "m64_n64_w4_s3", (("block_m", 64), ("block_n", 64), ("num_warps", 4), ("num_stages", 3))
)
_M64_N32_S3 = Tactic(
    "m64_n32_w4_s3", (("block_m", 64), ("block_n", 32), ("num_warps", 4), ("num_stages", 3))
)

PREFILL_TACTICS: tuple[Tactic, ...] = (
    Tactic(
        "m128_n64_w8_s2", (("block_m", 128), ("block_n", 64), ("num_warps", 8), ("num_stages", 2))
    ),
    Tactic(
        "m128_n32_w8_s3", (("block_m", 128), ("block_n", 32), ("num_warps", 8), ("num_stages", 3))
    ),
    Tactic(
        "m64_n64_w8_s3", (("block_m", 64), ("block_n", 64), ("num_warps", 8), ("num_stages", 3))
    ),
    _M64_N32_S3,
    # key tiles of 64: the fastest at 2,048 tokens on 64-token blocks (H200, 117-124 us a layer)
    Tactic(
        "m64_n64_w4_s2", (("block_m", 64), ("block_n", 64), ("num_warps", 4), ("num_stages", 2))
    ),
    _M64_N64_S3,
    Tactic(
        "m128_n64_w8_s3", (("block_m", 128), ("block_n", 64), ("num_warps", 8), ("num_stages", 3))
    ),
    Tactic(
        "m16_n64_w4_s2", (("block_m", 16), ("block_n", 64), ("num_warps", 4), ("num_stages", 2))
    ),
    # one diagonal tile per query tile; K+V tiles of 64 KB per stage
    Tactic(
        "m128_n128_w8_s2",
        (("block_m", 128), ("block_n", 128), ("num_warps", 8), ("num_stages", 2)),
    ),
    # GQA packing: 128 rows = 128 / G queries x the G q heads of one kv head
    Tactic(
        "m128_n64_w8_s2_gqa",
        (("block_m", 128), ("block_n", 64), ("num_warps", 8), ("num_stages", 2), ("gqa", 1)),
    ),
    # each key tile's block-table entries read a tile ahead: at num_stages 3 Triton's pipeliner
    # then keeps two K/V tiles in flight where it kept one (sm_90 TTGIR). H100, 2,048 tokens
    # (docs/performance.md 12-06 17:00): FP8 cache on 64-token blocks 143.0 us against 151.3
    # for the best other tactic, 101.9 against 117.9 with fp8_queries; BF16 on 32-token
    # blocks (m64_n32) 125.2 against 130.6
    read_ahead(_M64_N64_S3),
    read_ahead(_M64_N32_S3),
)


def prefill_tactic(bm: int, bn: int, w: int, s: int, gqa: bool = False) -> Tactic:
    """The prefill tactic of BLOCK_M bm, BLOCK_N bn, w warps, s stages (GQA-packed: gqa)."""
    p = (("block_m", bm), ("block_n", bn), ("num_warps", w), ("num_stages", s))
    return Tactic(f"m{bm}_n{bn}_w{w}_s{s}" + "_gqa" * gqa, p + (("gqa", 1),) * gqa)


# Launches whose longest prompt has at most SHORT_PROMPT queries (a 128/128 mixed step: ~64
# prompts of 128 tokens) run a tactic's short-prompt prefill tactic, which the build times at
# such a batch among PREFILL_TACTICS and these (`combine_tactics(short_prefill=)`): the
# 2,048-token pick took 159 us a layer there in the H100 profile (docs/performance.md 12-06
# 11:20), ~4x what its bytes take at the copy bandwidth. These give each program less work
# (narrower query tiles) or load K/V once for a kv head's q heads (GQA packing); none spills
# on sm_90 with an FP8 cache (m128_n64_w4_s2_gqa did: 255 registers, 19 spills in its loops).
SHORT_PROMPT = 256
# the batch the build times them on (prompts, tokens each), engine limits allowing
SHORT_PROMPT_BATCH = (64, SHORT_PROMPT // 2)
SHORT_PROMPT_TACTICS: tuple[Tactic, ...] = (
    prefill_tactic(64, 64, 4, 2, gqa=True),
    # the H100's pick on 64 prompts of 128 tokens: 83.6 us against 101.3 for the 2,048-token
    # pick (docs/performance.md 12-06 20:00); the three after it are its neighbours, not yet
    # timed (sm_90: 155-192 registers, no spills)
    prefill_tactic(64, 32, 4, 2, gqa=True),
    prefill_tactic(64, 32, 4, 3, gqa=True),
    prefill_tactic(64, 16, 4, 2, gqa=True),
    prefill_tactic(32, 32, 2, 2, gqa=True),
    prefill_tactic(32, 64, 4, 2),
    prefill_tactic(32, 32, 2, 2),
    prefill_tactic(16, 32, 2, 2),
)

LOG2E = 1.4426950408889634


@triton.jit
def fp16_query(q, scale_log2):
    """An FP8 KV cache's dots run in fp16, not in q's bf16: e4m3 -> fp16 is one conversion
    per pair of elements on sm_89+, e4m3 -> bf16 goes through fp16 and costs 1.5 per element,
    and the conversion unit's throughput bounds the kernel. Both are exact. A bf16 q is scaled
    by 1/16 (exact) so that |q| up to 2^20 fits fp16; the 16 joins the softmax scale."""
    if q.dtype == tl.bfloat16:
        # NOTE: scaled in bf16, then converted: LLVM rewrites fp16(fp32(q) * c) as
        # fp16(q) * c, which overflows past 65504 (seen on sm_90)
        q = (q * 0.0625).to(tl.float16)
        scale_log2 = scale_log2 * 16.0
    return q, scale_log2


@triton.jit
def fp8_query(q, scale_log2):
    """FP8_QK: each query row (a query of one head) times 448 / amax, rounded to float8_e4m3fn
    (the reference's `fp8_query_rows`, bit for bit), so that the Q.K dot runs on FP8 tensor
    cores straight from the cache's FP8 K; the row's scale amax / 448 joins the softmax scale,
    which becomes one per row ([BLOCK_M]). Two divisions a row, a multiply an element."""
    qs, row_scale = fp8_query_scaled(q, scale_log2)
    return to_fp8(qs), row_scale


@triton.jit
def fp8_query_scaled(q, scale_log2):
    """fp8_query before its rounding: each row times 448 / amax (fp32), and the row scales."""
    qf = q.to(tl.float32)
    amax = tl.max(tl.abs(qf), axis=1)
    big = amax > 1e-30  # (448 / amax overflows below ~1e-36: such a row stays unscaled)
    inv = tl.where(big, tl.math.div_rn(448.0, tl.maximum(amax, 1e-30)), 1.0)
    sq = tl.where(big, tl.math.div_rn(amax, 448.0), 1.0)
    return qf * inv[:, None], scale_log2 * sq


@triton.jit
def tile_blocks(bt_row, n0, hi, BS: tl.constexpr, BLOCK_N: tl.constexpr):
    """The block-table entries of the key tile at n0 (a multiple of BLOCK_N), as int64: the one
    block holding it when a block holds a multiple of BLOCK_N tokens, else its BLOCK_N // BS
    blocks ([NB]; those past `hi` read block 0, keys the tile masks or gives p = 0)."""
    if BS % BLOCK_N == 0:  # NOTE: one return: Triton compiles the code after a constexpr return
        blk = tl.load(bt_row + n0 // BS, mask=n0 < hi, other=0)
    else:
        j = tl.arange(0, BLOCK_N // BS)
        blk = tl.load(bt_row + n0 // BS + j, mask=n0 + j * BS < hi, other=0)
    return blk.to(tl.int64)


@triton.jit
def kv_tile(
    bt_row, n0, tv, kvh, s_blk, s_tok, s_h, BS: tl.constexpr, BLOCK_N: tl.constexpr, blk=None
):
    """(base, rows): keys n0 .. n0 + BLOCK_N - 1 of kv head kvh sit at cache + base + rows[i]
    (n0 is a multiple of BLOCK_N). When a block holds a multiple of BLOCK_N tokens the tile
    lies in one block: one block-table read, a scalar 64-bit base and 32-bit offsets (the
    per-token gather and 64-bit address arithmetic cost an FP8 cache, half the bytes per
    token of a BF16 one, a large share of its time). blk: the tile's blocks, already read
    (tile_blocks'), or None."""
    t = n0 + tl.arange(0, BLOCK_N)
    if BS % BLOCK_N == 0:
        if blk is None:
            blk = tl.load(bt_row + n0 // BS).to(tl.int64)
        base = blk * s_blk + kvh * s_h
        rows = (t % BS) * s_tok
    else:
        base = kvh.to(tl.int64) * s_h
        if blk is None:
            blk = tl.load(bt_row + t // BS, mask=tv, other=0).to(tl.int64)
            rows = blk * s_blk + (t % BS).to(tl.int64) * s_tok
        else:  # [NB] blocks of BS keys each, in order
            r = tl.arange(0, BS).to(tl.int64) * s_tok
            rows = tl.reshape(blk[:, None] * s_blk + r[None, :], (BLOCK_N,))
    return base, rows


@triton.jit
def load_blocks(ptr, base, s_tok, s_d, d, mask, BS: tl.constexpr, BLOCK_N: tl.constexpr):
    """A [BLOCK_N, D_PAD] tile of whole blocks: block i's BS tokens at ptr + base[i] + token *
    s_tok + dim * s_d, loaded as [NB, BS, D_PAD] (a scalar base per block, no per-key table
    gather) and merged. mask: [NB, BS, D_PAD] or None (a whole tile)."""
    r = tl.arange(0, BS)
    ptr = ptr + base[:, None, None] + (r * s_tok)[None, :, None] + (d * s_d)[None, None, :]
    if mask is None:
        x = tl.load(ptr)
    else:
        x = tl.load(ptr, mask=mask, other=0.0)
    return tl.reshape(x, (BLOCK_N, d.shape[0]))


@triton.jit
def load_v(
    vc_ptr, base, off, kv_mask, bt_row, n0, hi, tv, kvh, d, dm, s_blk,
    HD: tl.constexpr, BS: tl.constexpr, V_T: tl.constexpr, BLOCK_N: tl.constexpr, blk=None,
):  # fmt: skip
    """The V tile [BLOCK_N, D_PAD] of keys n0 .. n0 + BLOCK_N - 1 (n0 a multiple of BLOCK_N;
    dims outside `dm` read 0, keys outside `tv` read 0 or, below, finite values whose p is 0;
    `hi` bounds the keys that exist). Not V_T: V shares K's layout, so K's tile
    offsets (base, off, kv_mask) serve. V_T: V is stored transposed per block (layout.py:
    [Hkv, HD, BS] per block of K's size s_blk). When the tile lies in one block it is read
    with tokens contiguous and unmasked along them, so the P.V dot gets V in the order it
    needs; keys past the context in that block hold finite values (the pool is zero-filled,
    FP8 writes saturate) and their p is 0. blk: the tile's blocks, already read (tile_blocks'),
    or None."""
    if not V_T:
        if kv_mask is None:  # the whole tile (prefill below the diagonal)
            v = tl.load(vc_ptr + base + off)
        else:
            v = tl.load(vc_ptr + base + off, mask=kv_mask, other=0.0)
        return v
    # NOTE: one if/elif/else, no early returns: Triton would still compile the branches after
    # a constexpr branch's return, with that branch's `blk` (a scalar where they take [NB])
    if BS % BLOCK_N == 0:
        if blk is None:
            blk = tl.load(bt_row + n0 // BS).to(tl.int64)
        vb = blk * s_blk + kvh * (HD * BS)
        r = tl.max_contiguous(tl.multiple_of(n0 % BS + tl.arange(0, BLOCK_N), BLOCK_N), BLOCK_N)
        v = tl.load(vc_ptr + vb + r[:, None] + d[None, :] * BS, mask=dm[None, :], other=0.0)
    elif BLOCK_N % BS == 0:  # whole blocks: [blocks, BS, D] with tokens contiguous in each
        # NOTE: blocks past the context read block 0 (finite values; their p is 0)
        if blk is None:
            blk = tile_blocks(bt_row, n0, hi, BS, BLOCK_N)
        v = load_blocks(vc_ptr, blk * s_blk + kvh * (HD * BS), 1, BS, d, dm[None, None, :],
                        BS, BLOCK_N)  # fmt: skip
    else:
        vb, rows = kv_tile(bt_row, n0, tv, kvh, s_blk, 1, HD * BS, BS, BLOCK_N)
        if kv_mask is None:
            kv_mask = tv[:, None] & dm[None, :]
        v = tl.load(vc_ptr + vb + rows[:, None] + d[None, :] * BS, mask=kv_mask, other=0.0)
    return v


@triton.jit
def _attend(
    q,
    acc,
    m_i,
    l_i,
    n0,
    hi,
    qpos,
    kc_ptr,
    vc_ptr,
    bt_row,
    kvh,
    d,
    dm,
    scale_log2,
    window,
    BS: tl.constexpr,
    s_blk,
    s_tok,
    s_h,
    HD: tl.constexpr,
    V_T: tl.constexpr,
    MASKED: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    IEEE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    D_PAD: tl.constexpr,
    FP8_QK: tl.constexpr = False,
    blk=None,
):
    """One BLOCK_N tile of keys into the online softmax. MASKED=False: every key of the tile
    is visible to every query of the tile (below the causal diagonal, inside the context).
    FP8_QK: q is FP8 (fp8_query) and scale_log2 one scale per row; P.V stays in fp16. blk: the
    tile's block, read a tile ahead (BT_AHEAD), or None."""
    t = n0 + tl.arange(0, BLOCK_N)
    tv = t < hi
    base, rows = kv_tile(bt_row, n0, tv, kvh, s_blk, s_tok, s_h, BS, BLOCK_N, blk)
    off = rows[:, None] + d[None, :]
    # an FP8 cache's K/V convert exactly to q's dtype (fp16: fp16_query); their scales are
    # applied outside the loop
    if MASKED or HD != D_PAD:
        kv_mask = tv[:, None] & dm[None, :]
    else:  # a whole tile of keys and dims: no masks (fewer instructions per load)
        kv_mask = None
    if BS % BLOCK_N != 0 and blk is not None:  # [NB] blocks read ahead: K a block at a time
        k_mask = None
        if kv_mask is not None:
            t3 = n0 + tl.arange(0, BLOCK_N // BS)[:, None] * BS + tl.arange(0, BS)[None, :]
            k_mask = (t3 < hi)[:, :, None] & dm[None, None, :]
        k = load_blocks(kc_ptr, blk * s_blk + kvh * s_h, s_tok, 1, d, k_mask, BS, BLOCK_N)
    elif kv_mask is not None:
        k = tl.load(kc_ptr + base + off, mask=kv_mask, other=0.0)
    else:
        k = tl.load(kc_ptr + base + off)
    # NOTE: float32 engines must not round to TF32 (they are checked token for token).
    if IEEE:
        s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k.to(q.dtype)))
    if MASKED:
        vis = (t[None, :] <= qpos[:, None]) & tv[None, :]
        if USE_WINDOW:
            vis = vis & (t[None, :] > qpos[:, None] - window)
        s = tl.where(vis, s, float("-inf"))
    # the scale applied to the row max (exact: scale_log2 > 0 and rounding is monotonic) and
    # inside the exponent's FMA: one instruction per score instead of a multiply and a subtract
    m_new = tl.maximum(m_i, tl.max(s, axis=1) * scale_log2)
    alpha = tl.exp2(m_i - m_new)
    if FP8_QK:
        p = tl.exp2(s * scale_log2[:, None] - m_new[:, None])
    else:
        p = tl.exp2(s * scale_log2 - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    v = load_v(
        vc_ptr,
        base,
        off,
        kv_mask,
        bt_row,
        n0,
        hi,
        tv,
        kvh,
        d,
        dm,
        s_blk,
        HD,
        BS,
        V_T,
        BLOCK_N,
        blk,
    )
    # the rescaled accumulator goes into the P.V dot (accumulated by the tensor cores: no
    # second [BLOCK_M, D] fp32 tile and add)
    if IEEE:
        acc = tl.dot(p.to(q.dtype), v.to(q.dtype), acc * alpha[:, None], input_precision="ieee")
    elif FP8_QK:
        acc = tl.dot(p.to(tl.float16), v.to(tl.float16), acc * alpha[:, None])
    else:
        acc = tl.dot(p.to(q.dtype), v.to(q.dtype), acc * alpha[:, None])
    return acc, m_new, l_i


@triton.jit
def out_values(o, q_ptr, out_ptr, os_ptr, QUANT_OUT: tl.constexpr):
    """The attention output o (fp32) as stored: in out's dtype, or QUANT_OUT: rounded to the
    model dtype (q's) and quantized to FP8 with the scale at os_ptr, the bits the quantize
    kernel would have written from the model-dtype output (the FP8 o projection's input)."""
    if QUANT_OUT:
        return quant_fp8(o.to(q_ptr.dtype.element_ty).to(tl.float32), tl.load(os_ptr))
    return o.to(out_ptr.dtype.element_ty)


@triton.jit
def _prefill_kernel(
    q_ptr,
    kc_ptr,
    vc_ptr,
    ks_ptr,
    vs_ptr,
    bt_ptr,
    ctx_ptr,
    qsl_ptr,
    out_ptr,
    os_ptr,
    scale_log2,
    window,
    G,
    HD: tl.constexpr,
    BS: tl.constexpr,
    sqt,
    sqh,
    sot,
    soh,
    s_blk,
    s_tok,
    s_h,
    s_bt,
    V_T: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    IEEE: tl.constexpr,
    KV_FP8: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    D_PAD: tl.constexpr,
    PDL: tl.constexpr = False,
    PACK: tl.constexpr = 1,
    QUANT_OUT: tl.constexpr = False,
    SKIP_SINGLE: tl.constexpr = False,
    FP8_QK: tl.constexpr = False,
    BT_AHEAD: tl.constexpr = False,
):
    """PACK = 1: program (query tile, q head, sequence), BLOCK_M queries of one head. PACK = G
    (GQA packing): program (query tile, kv head, sequence); its BLOCK_M rows are the
    BLOCK_M // G queries of the tile for each of the G q heads sharing that kv head, so every
    K/V tile is loaded once for the group instead of once per head. SKIP_SINGLE: sequences of
    one query are left alone (the decode kernel takes them: ANY_DECODES). FP8_QK (an FP8
    cache): queries rounded to FP8 per row, Q.K on FP8 tensor cores (fp8_query). BT_AHEAD (key
    tiles inside one block): each tile's block-table entry read a tile ahead."""
    pdl_begin(PDL)
    QM: tl.constexpr = BLOCK_M // PACK  # queries per tile
    # NOTE: the last query tiles (the most keys under causal masking) start first.
    mt = tl.num_programs(0) - 1 - tl.program_id(0)
    b = tl.program_id(2)
    q0 = tl.load(qsl_ptr + b)
    qlen = tl.load(qsl_ptr + b + 1) - q0
    live = mt * QM < qlen
    if SKIP_SINGLE:
        live = live & (qlen > 1)
    if live:
        ctx = tl.load(ctx_ptr + b)
        r = tl.arange(0, BLOCK_M)
        if PACK == 1:
            heads = tl.program_id(1) + r * 0
            kvh = tl.program_id(1) // G
        else:
            kvh = tl.program_id(1)
            heads = kvh * PACK + r // QM
        offs_m = mt * QM + r % QM
        d = tl.arange(0, D_PAD)
        dm = d < HD
        rows = (q0 + offs_m).to(tl.int64)
        mrow = offs_m < qlen
        q = tl.load(
            q_ptr + rows[:, None] * sqt + heads[:, None] * sqh + d[None, :],
            mask=mrow[:, None] & dm[None, :],
            other=0.0,
        )
        first = ctx - qlen + mt * QM  # position of the tile's first query
        qpos = first + r % QM
        hi = tl.minimum(ctx, first + QM)
        m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
        bt_row = bt_ptr + b.to(tl.int64) * s_bt
        # NOTE: a new name: with FP8_QK the scale becomes a [BLOCK_M] tensor inside this
        # runtime branch, which the argument's scalar type cannot carry out of it
        sc = scale_log2
        if KV_FP8:  # q . (k * ks) == (q . k) * ks: the K scale joins the softmax scale
            sc = sc * tl.load(ks_ptr)
            if FP8_QK:
                q, sc = fp8_query(q, sc)
            elif not IEEE:
                q, sc = fp16_query(q, sc)
        lo = 0
        if USE_WINDOW:
            lo = tl.maximum(first - window + 1, 0) // BLOCK_N * BLOCK_N
        # BT_AHEAD: the K/V addresses come from the loops' carried entry, not from a load in
        # the same iteration, so that Triton's pipeliner keeps more than one tile in flight
        blk = tile_blocks(bt_row, lo, hi, BS, BLOCK_N) if BT_AHEAD else None
        if not USE_WINDOW:
            # keys before the tile's first query are seen by all its queries: no mask
            full = (first + 1) // BLOCK_N * BLOCK_N
            for n0 in range(0, full, BLOCK_N):
                if BT_AHEAD:
                    nxt = tile_blocks(bt_row, n0 + BLOCK_N, hi, BS, BLOCK_N)
                acc, m_i, l_i = _attend(
                    q, acc, m_i, l_i, n0, hi, qpos, kc_ptr, vc_ptr, bt_row,
                    kvh, d, dm, sc, window, BS, s_blk, s_tok, s_h,
                    HD, V_T, False, USE_WINDOW, IEEE, BLOCK_N, D_PAD, FP8_QK, blk,
                )  # fmt: skip
                if BT_AHEAD:
                    blk = nxt
            lo = full
        for n0 in range(lo, hi, BLOCK_N):
            if BT_AHEAD:
                nxt = tile_blocks(bt_row, n0 + BLOCK_N, hi, BS, BLOCK_N)
            acc, m_i, l_i = _attend(
                q, acc, m_i, l_i, n0, hi, qpos, kc_ptr, vc_ptr, bt_row,
                kvh, d, dm, sc, window, BS, s_blk, s_tok, s_h,
                HD, V_T, True, USE_WINDOW, IEEE, BLOCK_N, D_PAD, FP8_QK, blk,
            )  # fmt: skip
            if BT_AHEAD:
                blk = nxt
        if KV_FP8:  # sum p (v * vs) == vs * sum p v
            acc = acc * tl.load(vs_ptr)
        l_i = tl.where(l_i > 0.0, l_i, 1.0)
        o = acc / l_i[:, None]
        tl.store(
            out_ptr + rows[:, None] * sot + heads[:, None] * soh + d[None, :],
            out_values(o, q_ptr, out_ptr, os_ptr, QUANT_OUT),
            mask=mrow[:, None] & dm[None, :],
        )


def launch_prefill(
    q,
    k_cache,
    v_cache,
    block_tables,
    context_lens,
    query_start_loc,
    scale,
    window,
    max_query_len,
    out,
    params,
    k_scale=None,
    v_scale=None,
    out_scale=None,
    skip_single=False,
    fp8_queries=False,
) -> None:
    """Launch the prefill kernel. `window` <= 0 means no sliding window; `max_query_len` sizes
    the grid (an upper bound is fine). k_scale / v_scale: an FP8 KV cache's scales (float32 [])
    or None (then the kernel is the plain one). out_scale: out is float8_e4m3fn, the output
    quantized with it (float32 []). skip_single: sequences of one query are not attended (the
    decode kernel's, ANY_DECODES). fp8_queries (an FP8 cache only): every query rounded to FP8
    with its row's scale (reference.fp8_query_rows) and Q.K run in FP8."""
    T, hq, hd = q.shape
    hkv = k_cache.shape[2]
    B = context_lens.shape[0]
    if T == 0 or B == 0 or max_query_len <= 0:
        return
    block_m = int(params.get("block_m", 128))
    g = hq // hkv
    # GQA packing needs whole, power-of-two groups that divide the tile
    pack = g if params.get("gqa") and g > 1 and g & (g - 1) == 0 and block_m % g == 0 else 1
    grid = (triton.cdiv(max_query_len, block_m // pack), hq // pack, B)
    fp8 = k_scale is not None and v_scale is not None
    if fp8_queries and (not fp8 or q.dtype == torch.float32):
        raise ValueError("paged_attention: fp8_queries needs an FP8 KV cache and 16-bit queries")
    v_t = check_kv_layout(k_cache, v_cache, "paged_attention")
    _prefill_kernel[grid](
        q,
        k_cache,
        v_cache,
        k_scale if fp8 else None,
        v_scale if fp8 else None,
        block_tables,
        context_lens,
        query_start_loc,
        out,
        out_scale,
        float(scale) * LOG2E,
        int(window),
        g,
        hd,
        k_cache.shape[1],
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        V_T=v_t,
        USE_WINDOW=window > 0,
        IEEE=q.dtype == torch.float32,
        KV_FP8=fp8,
        BLOCK_M=block_m,
        BLOCK_N=int(params.get("block_n", 64)),
        D_PAD=max(16, triton.next_power_of_2(hd)),
        num_warps=int(params.get("num_warps", 4)),
        num_stages=int(params.get("num_stages", 2)),
        PACK=pack,
        QUANT_OUT=out_scale is not None,
        SKIP_SINGLE=skip_single,
        FP8_QK=fp8_queries,
        BT_AHEAD=bool(params.get("bt_ahead")),
        **launch_options(),
    )


def make_prefill_attention(tactic: Tactic | None = None):
    """The prefill kernel alone (any q_len per sequence), with the reference's contract."""
    params = (tactic or PREFILL_TACTICS[0]).as_dict()

    def prefill_attention(
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
        query_start_loc: torch.Tensor,
        scale: float,
        sliding_window: int | None = None,
        *,
        max_query_len: int | None = None,
        out: torch.Tensor | None = None,
        k_scale: torch.Tensor | None = None,
        v_scale: torch.Tensor | None = None,
        fp8_queries: bool = False,
    ) -> torch.Tensor:
        out = torch.empty_like(q) if out is None else out
        if max_query_len is None:
            max_query_len = q.shape[0]  # upper bound; no host sync
        window = int(sliding_window) if sliding_window else 0
        launch_prefill(
            q,
            k_cache,
            v_cache,
            block_tables,
            context_lens,
            query_start_loc,
            scale,
            window,
            max_query_len,
            out,
            params,
            k_scale,
            v_scale,
            fp8_queries=fp8_queries,
        )
        return out

    return prefill_attention
