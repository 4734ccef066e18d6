"""The W4A16 decode GEMV on the tensor cores (tactics with `mma`), reading the engine layout.

The CUDA-core GEMVs (`triton_w4a16.py`) spend ~2.9 sm_90 instructions per weight (the packed
loop): at 4 bits a weight the H200 leaves ~3.5 issue slots per weight for a DRAM-bound GEMV,
and they ran at 40-66% of the copy bandwidth. Here a warp multiplies 16 weight rows by x's
rows with `mma.sync.m16n8k16` (bf16 in, fp32 accumulate): per 8 weights a lane does 3 shifts
and 4 LOP3s (a code pair masked into the mantissas of 128.0: 128 + u, exact) and one MMA.
The -136 that turns 128 + u into u - 8 is one more MMA per step
with a constant A (-136 in every element), shared by all the program's row tiles: the sums
stay exact products accumulated in fp32.

Lane l of a warp holds, as the MMA's fragments want (g = l // 4, q = l % 4): A rows g and
g + 8 at slots 2q, 2q + 1, 2q + 8, 2q + 9; B (x) at those slots for x row n = g; D rows g,
g + 8 at columns 2q, 2q + 1. With the engine's interleaved blocks (word c of a 128-k block
holds k = 16 j + c in nibble j), lane (g, q) loads words 4q .. 4q + 3 of a block of rows g
and g + 8 (16 bytes each; a warp reads each row's 64-byte block whole), and word 4q + t gives
steps (t, s), s = 0, 1: slots 2q, 2q + 1 are nibbles 2s, 2s + 4 (k = 16 (2s) + 4q + t and
16 (2s + 4) + 4q + t), slots 2q + 8, 2q + 9 nibbles 2s + 1, 2s + 5. So a block is 8 MMAs per
16 rows; x is loaded by the lanes of rows n < T as 4 consecutive k a load and packed in pairs.

Every tensor is [32 WARPS] (one element a thread) or [32 WARPS, 4] (a lane's 16- or 8-byte
load): with one dimension past the lane's own registers, Triton keeps element i on thread i,
and the inline `mma.sync`, which runs once per element, takes each lane's registers as that
lane's fragments (`tests/test_w4a16_mma.py` checks the compiled layouts: a 5-D version put
lanes across its other axes). Warps split K (warp w takes blocks (it * WARPS + w) * UNROLL +
u); their sums are added at the end; a program owns 16 TILES rows (1, 2 or 4). The x side (x
and pre_quant_scale loads, their bf16x2 product, PRMT packing, the -136 MMAs) is per block
and warp, shared by the tiles: sm_90 loop 2.1 instructions a weight with 2 tiles, 2.6-2.8
with one (`scripts/sass_w4a16.py`), against 2.9 for the packed CUDA-core loop. bf16 x only,
T <= 8; no folded norm or residual add, and SwiGLU runs as a kernel before it (the launcher
and `mma_takes`). Under Triton's interpreter the MMA is emulated from the fragments' layout.
On the H100 (2026-12-05): right (`tests/test_gpu_quant.py`), but at batch 1 slower than the
CUDA-core GEMVs at every Llama site (qkv 12.3 us against 9.2, o 9.2 / 7.3, gate_up 36.0 /
28.1, down 23.8 / 22.6; `scripts/bench_w4a16.py`): fewer instructions a weight did not make
it faster, so issue is not its bound. Likely the bytes in flight: a lane loads a block's 32
bytes a tile and waits for them, with no next block loaded before this one's MMAs (the
persistent kernel keeps one chunk in flight). The build still times these tactics per site;
the `_pf` ones (PREFETCH) load each block a pass ahead (the H100 timed them slower still).
XTILES (medium decode batches, `triton_w4a16.MID_TACTICS`): 2 or 4 groups of 8 x rows, each
group's MMAs taking the same weight fragments, so one pass over the weights serves 16 or 32
rows.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

from ..pdl import pdl_begin

_INTERPRET = tl.constexpr(os.environ.get("TRITON_INTERPRET") == "1")
_MMA = tl.constexpr(
    "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
    "{$0, $1, $2, $3}, {$4, $5, $6, $7}, {$8, $9}, {$10, $11, $12, $13};"
)
MAGIC2 = 0x43004300  # 128.0 in both bf16 halves (run time: a register, so one LOP3 a pair)
NEG136 = 0xC308C308 - (1 << 32)  # -136.0 in both bf16 halves, as an int32 (run time: a register)


@triton.jit
def _halves(v):
    """bf16x2 words -> (low, high) halves as fp32."""
    return (v << 16).to(tl.float32, bitcast=True), (v & -65536).to(tl.float32, bitcast=True)


@triton.jit
def _slots(lo_pair, hi_pair):
    """Per lane (g, q) [M, 32] bf16x2 words holding slots (2q, 2q + 1) and (2q + 8, 2q + 9) of
    fragment row g -> [M, 8, 16] fp32: each row g's 16 slots in order."""
    M: tl.constexpr = lo_pair.shape[0]
    a, b = _halves(lo_pair)
    c, d = _halves(hi_pair)
    first = tl.reshape(tl.join(a, b), [M, 8, 8])  # lane (g, q) -> slots 2q, 2q + 1
    second = tl.reshape(tl.join(c, d), [M, 8, 8])
    return tl.reshape(tl.permute(tl.join(first, second), (0, 1, 3, 2)), [M, 8, 16])


@triton.jit
def _lanes(d):
    """[M, 8 rows, 8 columns] -> per lane (g, q): columns 2q and 2q + 1 of row g, [M, 32]."""
    M: tl.constexpr = d.shape[0]
    even, odd = tl.split(tl.reshape(d, [M, 8, 4, 2]))
    return tl.reshape(even, [M, 32]), tl.reshape(odd, [M, 32])


@triton.jit
def _mma_emulated(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
    """The MMA computed from the fragments' layout, for the interpreter: [M, 32] per lane."""
    top, bottom = _slots(a0, a2), _slots(a1, a3)  # A rows g and g + 8: [M, 8, 16] each
    b = _slots(b0, b1)  # [M, 8 columns n, 16 slots]
    d_top = tl.sum(top[:, :, None, :] * b[:, None, :, :], axis=3)  # [M, 8, 8]
    d_bottom = tl.sum(bottom[:, :, None, :] * b[:, None, :, :], axis=3)
    d0, d1 = _lanes(d_top)
    d2, d3 = _lanes(d_bottom)
    return c0 + d0, c1 + d1, c2 + d2, c3 + d3


@triton.jit
def _flat(v, M: tl.constexpr):
    return tl.reshape(v, [M, 32])


@triton.jit
def _mma(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
    """D = A B + C: one m16n8k16 bf16 MMA per element; all [32 WARPS] (element i on thread
    i), the A and B fragments int32 bf16x2 words, C and D fp32."""
    if _INTERPRET:
        M: tl.constexpr = c0.shape[0] // 32
        d0, d1, d2, d3 = _mma_emulated(
            _flat(a0, M), _flat(a1, M), _flat(a2, M), _flat(a3, M), _flat(b0, M),
            _flat(b1, M), _flat(c0, M), _flat(c1, M), _flat(c2, M), _flat(c3, M),
        )  # fmt: skip
        n: tl.constexpr = c0.shape[0]
        return tl.reshape(d0, [n]), tl.reshape(d1, [n]), tl.reshape(d2, [n]), tl.reshape(d3, [n])
    else:
        return tl.inline_asm_elementwise(
            asm=_MMA,
            constraints="=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f",
            args=[a0, a1, a2, a3, b0, b1, c0, c1, c2, c3],
            dtype=(tl.float32, tl.float32, tl.float32, tl.float32),
            is_pure=True,
            pack=1,
        )


@triton.jit
def _split4(v):
    """[n, 4] -> its four columns (a lane's registers)."""
    a, b = tl.split(tl.reshape(v, [v.shape[0], 2, 2]))
    t0, t1 = tl.split(a)
    t2, t3 = tl.split(b)
    return t0, t1, t2, t3


@triton.jit
def _nibble_pair(word, j: tl.constexpr, magic2):
    """Nibbles j and j + 4 of each word as bf16x2 128 + u (exact), nibble j low."""
    return ((word >> (4 * j)) & 0x000F000F) | magic2


@triton.jit
def _pack_bf16(lo, hi):
    """Two bf16 tensors -> int32 bf16x2 words, lo in the low half."""
    lo = lo.to(tl.uint16, bitcast=True).to(tl.uint32)
    return (lo | (hi.to(tl.uint16, bitcast=True).to(tl.uint32) << 16)).to(tl.int32, bitcast=True)


@triton.jit
def _x_pairs(x_ptr, pqs_ptr, x_off, k_off, j: tl.constexpr, HAS_PQS: tl.constexpr):
    """x (times pre_quant_scale, rounded to bf16 as the reference) at k_off + 16 j and
    k_off + 16 (j + 4), four consecutive k a lane ([n, 4]), packed as bf16x2 (j low)."""
    lo = tl.load(x_ptr + x_off + 16 * j)
    hi = tl.load(x_ptr + x_off + 16 * (j + 4))
    if HAS_PQS:
        p_lo = tl.load(pqs_ptr + k_off + 16 * j)
        p_hi = tl.load(pqs_ptr + k_off + 16 * (j + 4))
        lo = (lo.to(tl.float32) * p_lo.to(tl.float32)).to(tl.bfloat16)
        hi = (hi.to(tl.float32) * p_hi.to(tl.float32)).to(tl.bfloat16)
    return _interleave(lo, hi)


@triton.jit
def _interleave(lo, hi):
    """bf16 [n, 4] lo and hi -> int32 [n, 4] bf16x2 words (lo[t] low, hi[t] high): two PRMTs a
    pair of t (a lane's registers), where the casts and shifts took ~6 instructions a word."""
    if _INTERPRET:
        return _pack_bf16(lo, hi)
    else:
        return tl.inline_asm_elementwise(
            asm="prmt.b32 $0, $2, $3, 0x5410; prmt.b32 $1, $2, $3, 0x7632;",
            constraints="=r,=r,r,r",
            args=[lo, hi],
            dtype=tl.int32,
            is_pure=True,
            pack=2,
        )


@triton.jit
def _rows(rows, N):
    """Row indices as int64, rows past N clamped to row 0 (re-read, never stored)."""
    return tl.where(rows < N, rows, 0).to(tl.int64)


@triton.jit
def _prefetch_l2(ptrs):
    """Each lane's 16 bytes at ptrs (a [32 WARPS] tensor) fetched into L2, nothing returned;
    nothing under the interpreter (no cache to warm)."""
    if not _INTERPRET:
        tl.inline_asm_elementwise(
            asm="prefetch.global.L2 [$1]; mov.u32 $0, 0;",
            constraints="=r,l",
            args=[ptrs],
            dtype=tl.int32,
            is_pure=False,
            pack=1,
        )


@triton.jit
def _tile_load(qw_ptr, s_ptr, lo_rows, hi_rows, blk, ok, wo, KB, BLOCKS_PER_GROUP: tl.constexpr):
    """One block of one 16-row tile, loaded: a lane's 4 words of rows g and g + 8 ([n, 4]) and
    their group scales (0 for a block past K)."""
    w_lo = tl.load(qw_ptr + (lo_rows * (KB * 16))[:, None] + wo, eviction_policy="evict_first")
    w_hi = tl.load(qw_ptr + (hi_rows * (KB * 16))[:, None] + wo, eviction_policy="evict_first")
    sg = KB // BLOCKS_PER_GROUP
    s_lo = tl.where(ok, tl.load(s_ptr + lo_rows * sg + blk // BLOCKS_PER_GROUP), 0.0)
    s_hi = tl.where(ok, tl.load(s_ptr + hi_rows * sg + blk // BLOCKS_PER_GROUP), 0.0)
    return w_lo, w_hi, s_lo, s_hi


@triton.jit
def _tile_mma(w_lo, w_hi, s_lo, s_hi, pk0, pk1, pk2, pk3, c0, c1, c2, c3, a0, a1, a2, a3, magic2):
    """A loaded block's 8 MMAs (two chains from zero) plus the block's -136 sums (c), scaled
    by the rows' group scales and added to the tile's sums (a)."""
    w_lo = _split4(w_lo)
    w_hi = _split4(w_hi)
    # two chains of 4 dependent MMAs (s = 0, 1), each from zero: with the -136 chain, three
    # run side by side rather than one of 16
    d0, d1, d2, d3 = _tile_chain(w_lo, w_hi, pk0, pk1, 0, magic2)
    f0, f1, f2, f3 = _tile_chain(w_lo, w_hi, pk2, pk3, 1, magic2)
    s_lo = s_lo.to(tl.float32)
    s_hi = s_hi.to(tl.float32)
    a0 += s_lo * ((d0 + f0) + c0)
    a1 += s_lo * ((d1 + f1) + c1)
    a2 += s_hi * ((d2 + f2) + c2)
    a3 += s_hi * ((d3 + f3) + c3)
    return a0, a1, a2, a3


@triton.jit
def _tile_block(qw_ptr, s_ptr, lo_rows, hi_rows, blk, ok, wo, KB, pk0, pk1, pk2, pk3, c0, c1,
                c2, c3, a0, a1, a2, a3, magic2, BLOCKS_PER_GROUP: tl.constexpr):  # fmt: skip
    """One block of one 16-row tile: loaded, then its MMAs added to the tile's sums (a)."""
    w_lo, w_hi, s_lo, s_hi = _tile_load(qw_ptr, s_ptr, lo_rows, hi_rows, blk, ok, wo, KB,
                                        BLOCKS_PER_GROUP)  # fmt: skip
    return _tile_mma(w_lo, w_hi, s_lo, s_hi, pk0, pk1, pk2, pk3, c0, c1, c2, c3, a0, a1, a2, a3,
                     magic2)  # fmt: skip


@triton.jit
def _block_at(it, w, u: tl.constexpr, q, v, KB, WARPS: tl.constexpr, UNROLL: tl.constexpr):
    """Warp w's block u of pass `it` (block 0 past K, `ok` false) and a lane's word offsets in
    it (words 4q .. 4q + 3)."""
    blk = (it * WARPS + w) * UNROLL + u
    ok = blk < KB  # past K: block 0 read again, its scales taken as 0
    blk = tl.where(ok, blk, 0)
    return blk, ok, (blk * 16 + 4 * q)[:, None] + v


@triton.jit
def _tile_chain(w_lo, w_hi, pa, pb, s: tl.constexpr, magic2):
    """The block's 4 MMAs of step s (nibble pairs 2s, 2s + 1 of each of the 4 words; x
    pairs pa, pb), from zero."""
    d0 = tl.zeros(pa[0].shape, tl.float32)
    d1, d2, d3 = d0, d0, d0
    for t in tl.static_range(4):
        d0, d1, d2, d3 = _mma(
            _nibble_pair(w_lo[t], 2 * s, magic2), _nibble_pair(w_hi[t], 2 * s, magic2),
            _nibble_pair(w_lo[t], 2 * s + 1, magic2), _nibble_pair(w_hi[t], 2 * s + 1, magic2),
            pa[t], pb[t], d0, d1, d2, d3,
        )  # fmt: skip
    return d0, d1, d2, d3


@triton.jit
def _x_block(x_ptr, pqs_ptr, x_row, k_off, neg, zero, HAS_PQS: tl.constexpr):
    """One x tile's pairs for a block (x rows x_row, k offsets k_off) and the block's -136
    sums for them (c), which every weight tile's sums of the block take."""
    x_off = x_row[:, None] + k_off
    pk0 = _split4(_x_pairs(x_ptr, pqs_ptr, x_off, k_off, 0, HAS_PQS))
    pk1 = _split4(_x_pairs(x_ptr, pqs_ptr, x_off, k_off, 1, HAS_PQS))
    pk2 = _split4(_x_pairs(x_ptr, pqs_ptr, x_off, k_off, 2, HAS_PQS))
    pk3 = _split4(_x_pairs(x_ptr, pqs_ptr, x_off, k_off, 3, HAS_PQS))
    c0, c1, c2, c3 = zero, zero, zero, zero
    for t in tl.static_range(4):
        for s in tl.static_range(2):
            c0, c1, c2, c3 = _mma(neg, neg, neg, neg, pk0[t] if s == 0 else pk2[t],
                                  pk1[t] if s == 0 else pk3[t], c0, c1, c2, c3)  # fmt: skip
    return pk0, pk1, pk2, pk3, c0, c1, c2, c3


@triton.jit
def _x_tile_mma(x_ptr, pqs_ptr, x_row, k_off, neg, zero, w_lo, w_hi, s_lo, s_hi, a0, a1, a2,
                a3, magic2, HAS_PQS: tl.constexpr):  # fmt: skip
    """A further x tile (XTILES): its pairs and -136 sums, then the loaded block's MMAs for
    it, added to its sums (a)."""
    pk0, pk1, pk2, pk3, c0, c1, c2, c3 = _x_block(x_ptr, pqs_ptr, x_row, k_off, neg, zero,
                                                  HAS_PQS)  # fmt: skip
    return _tile_mma(w_lo, w_hi, s_lo, s_hi, pk0, pk1, pk2, pk3, c0, c1, c2, c3, a0, a1, a2, a3,
                     magic2)  # fmt: skip


@triton.jit
def _w4a16_mma_gemv_kernel(
    x_ptr, qw_ptr, s_ptr, pqs_ptr, b_ptr, out_ptr, T, N, KB, sxm, som, neg136, magic2,
    HAS_PQS: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCKS_PER_GROUP: tl.constexpr,
    WARPS: tl.constexpr, TILES: tl.constexpr, UNROLL: tl.constexpr, PDL: tl.constexpr = False,
    PREFETCH: tl.constexpr = False, XTILES: tl.constexpr = 1,
):  # fmt: skip
    """out[n, m] = sum_k (x[n, k] pqs[k]) (u[m, k] - 8) scales[m, k // G] (+ b[m]) for x rows
    n < T <= 8 and this program's 16 TILES (1, 2 or 4) weight rows (module docstring). Every
    tensor is [32 WARPS] (or [32 WARPS, 4]: a lane's 16 or 8 bytes): one dimension, so Triton
    keeps element i on thread i. neg136 and magic2: -136.0 and 128.0 in both bf16 halves,
    at run time. PDL: the first pass's weights are prefetched into L2 before the wait (they
    never depend on the kernel before), its loads after it then hit L2. PREFETCH (TILES 1,
    UNROLL <= 2): each block's words and scales are loaded a pass ahead, so a warp has its
    next pass's bytes in flight while it runs this one's MMAs (same sums, same bits).
    XTILES (2 or 4; TILES 1, no PREFETCH): x rows n < T <= 8 XTILES, 8 a group, each group's
    MMAs taking the same weight fragments (one pass over the weights for up to 32 rows); the
    groups past the first use the accumulators TILES > 1 would."""
    lane = tl.arange(0, 32 * WARPS)
    w, g, q = lane // 32, lane % 32 // 4, lane % 4
    v = tl.arange(0, 4)[None, :]
    rows = tl.program_id(0) * (16 * TILES) + g
    lo0, hi0 = _rows(rows, N), _rows(rows + 8, N)
    lo1, hi1 = _rows(rows + 16, N), _rows(rows + 24, N)
    lo2, hi2 = _rows(rows + 32, N), _rows(rows + 40, N)
    lo3, hi3 = _rows(rows + 48, N), _rows(rows + 56, N)
    if PDL:
        for u in tl.static_range(UNROLL):
            first = qw_ptr + (tl.minimum(w * UNROLL + u, KB - 1) * 16 + 4 * q)
            _prefetch_l2(first + lo0 * (KB * 16))
            _prefetch_l2(first + hi0 * (KB * 16))
            if TILES >= 2:
                _prefetch_l2(first + lo1 * (KB * 16))
                _prefetch_l2(first + hi1 * (KB * 16))
            if TILES == 4:
                _prefetch_l2(first + lo2 * (KB * 16))
                _prefetch_l2(first + hi2 * (KB * 16))
                _prefetch_l2(first + lo3 * (KB * 16))
                _prefetch_l2(first + hi3 * (KB * 16))
    pdl_begin(PDL)
    # x row n = g, lanes of rows n >= T reading row 0: D's columns past T are never stored
    x_row = tl.where(g < T, g, 0) * sxm
    x_row1 = tl.where(g + 8 < T, g + 8, 0) * sxm  # x tiles 1-3 (XTILES): rows 8 j + g
    x_row2 = tl.where(g + 16 < T, g + 16, 0) * sxm
    x_row3 = tl.where(g + 24 < T, g + 24, 0) * sxm
    zero = tl.zeros([32 * WARPS], tl.float32)
    neg = tl.full([32 * WARPS], neg136, tl.int32)
    a0, a1, a2, a3 = zero, zero, zero, zero  # tile 0's sums: rows g, g + 8 x columns 2q, 2q + 1
    e0, e1, e2, e3 = zero, zero, zero, zero  # tile 1's
    f0, f1, f2, f3 = zero, zero, zero, zero  # tile 2's
    h0, h1, h2, h3 = zero, zero, zero, zero  # tile 3's
    if PREFETCH:  # tile 0's blocks of the first pass, loaded ahead (UNROLL <= 2, TILES == 1)
        blk, ok, wo = _block_at(0, w, 0, q, v, KB, WARPS, UNROLL)
        wl0, wh0, sl0, sh0 = _tile_load(qw_ptr, s_ptr, lo0, hi0, blk, ok, wo, KB, BLOCKS_PER_GROUP)
        wl1, wh1, sl1, sh1 = wl0, wh0, sl0, sh0
        if UNROLL == 2:
            blk, ok, wo = _block_at(0, w, 1, q, v, KB, WARPS, UNROLL)
            wl1, wh1, sl1, sh1 = _tile_load(qw_ptr, s_ptr, lo0, hi0, blk, ok, wo, KB,
                                            BLOCKS_PER_GROUP)  # fmt: skip
    for it in range(0, tl.cdiv(KB, WARPS * UNROLL)):
        for u in tl.static_range(UNROLL):
            blk, ok, wo = _block_at(it, w, u, q, v, KB, WARPS, UNROLL)
            if PREFETCH:  # this block's words, loaded a pass ago; the next pass's go out now
                nblk, nok, nwo = _block_at(it + 1, w, u, q, v, KB, WARPS, UNROLL)
                if u == 0:
                    w_lo, w_hi, s_lo, s_hi = wl0, wh0, sl0, sh0
                    wl0, wh0, sl0, sh0 = _tile_load(qw_ptr, s_ptr, lo0, hi0, nblk, nok, nwo, KB,
                                                    BLOCKS_PER_GROUP)  # fmt: skip
                else:
                    w_lo, w_hi, s_lo, s_hi = wl1, wh1, sl1, sh1
                    wl1, wh1, sl1, sh1 = _tile_load(qw_ptr, s_ptr, lo0, hi0, nblk, nok, nwo, KB,
                                                    BLOCKS_PER_GROUP)  # fmt: skip
            else:
                w_lo, w_hi, s_lo, s_hi = _tile_load(qw_ptr, s_ptr, lo0, hi0, blk, ok, wo, KB,
                                                    BLOCKS_PER_GROUP)  # fmt: skip
            # x at k = 128 blk + 16 j + 4q + t (t = 0..3: a lane's 4 consecutive k)
            k_off = (blk * 128 + 4 * q)[:, None] + v
            pk0, pk1, pk2, pk3, c0, c1, c2, c3 = _x_block(x_ptr, pqs_ptr, x_row, k_off, neg,
                                                          zero, HAS_PQS)  # fmt: skip
            a0, a1, a2, a3 = _tile_mma(w_lo, w_hi, s_lo, s_hi, pk0, pk1, pk2, pk3, c0, c1, c2,
                                       c3, a0, a1, a2, a3, magic2)  # fmt: skip
            if XTILES >= 2:  # more x rows: the same weight fragments, other x pairs
                e0, e1, e2, e3 = _x_tile_mma(x_ptr, pqs_ptr, x_row1, k_off, neg, zero, w_lo,
                                             w_hi, s_lo, s_hi, e0, e1, e2, e3, magic2,
                                             HAS_PQS)  # fmt: skip
            if XTILES == 4:
                f0, f1, f2, f3 = _x_tile_mma(x_ptr, pqs_ptr, x_row2, k_off, neg, zero, w_lo,
                                             w_hi, s_lo, s_hi, f0, f1, f2, f3, magic2,
                                             HAS_PQS)  # fmt: skip
                h0, h1, h2, h3 = _x_tile_mma(x_ptr, pqs_ptr, x_row3, k_off, neg, zero, w_lo,
                                             w_hi, s_lo, s_hi, h0, h1, h2, h3, magic2,
                                             HAS_PQS)  # fmt: skip
            if TILES >= 2:
                e0, e1, e2, e3 = _tile_block(qw_ptr, s_ptr, lo1, hi1, blk, ok, wo, KB, pk0, pk1,
                                             pk2, pk3, c0, c1, c2, c3, e0, e1, e2, e3,
                                             magic2, BLOCKS_PER_GROUP)  # fmt: skip
            if TILES == 4:
                f0, f1, f2, f3 = _tile_block(qw_ptr, s_ptr, lo2, hi2, blk, ok, wo, KB, pk0, pk1,
                                             pk2, pk3, c0, c1, c2, c3, f0, f1, f2, f3,
                                             magic2, BLOCKS_PER_GROUP)  # fmt: skip
                h0, h1, h2, h3 = _tile_block(qw_ptr, s_ptr, lo3, hi3, blk, ok, wo, KB, pk0, pk1,
                                             pk2, pk3, c0, c1, c2, c3, h0, h1, h2, h3,
                                             magic2, BLOCKS_PER_GROUP)  # fmt: skip
    _store(a0, a1, a2, a3, rows, q, b_ptr, out_ptr, T, N, som, WARPS, HAS_BIAS)
    if XTILES >= 2:  # x tile j: out rows 8 j + n
        _store(e0, e1, e2, e3, rows, q, b_ptr, out_ptr + 8 * som, T - 8, N, som, WARPS, HAS_BIAS)
    if XTILES == 4:
        _store(f0, f1, f2, f3, rows, q, b_ptr, out_ptr + 16 * som, T - 16, N, som, WARPS,
               HAS_BIAS)  # fmt: skip
        _store(h0, h1, h2, h3, rows, q, b_ptr, out_ptr + 24 * som, T - 24, N, som, WARPS,
               HAS_BIAS)  # fmt: skip
    if TILES >= 2:
        _store(e0, e1, e2, e3, rows + 16, q, b_ptr, out_ptr, T, N, som, WARPS, HAS_BIAS)
    if TILES == 4:
        _store(f0, f1, f2, f3, rows + 32, q, b_ptr, out_ptr, T, N, som, WARPS, HAS_BIAS)
        _store(h0, h1, h2, h3, rows + 48, q, b_ptr, out_ptr, T, N, som, WARPS, HAS_BIAS)


@triton.jit
def _store(a0, a1, a2, a3, rows, q, b_ptr, out_ptr, T, N, som, WARPS: tl.constexpr,
           HAS_BIAS: tl.constexpr):  # fmt: skip
    """A tile's sums, added over the warps: lane (g, q) holds rows g (a0, a1) and g + 8 (a2,
    a3) at x rows 2q (a0, a2) and 2q + 1 (a1, a3)."""
    rows = tl.reshape(rows, [WARPS, 32])
    q = tl.reshape(q, [WARPS, 32])
    for half in tl.static_range(2):
        r = rows + 8 * half
        ok = r < N
        for col in tl.static_range(2):
            acc = a0
            if half == 0 and col == 1:
                acc = a1
            if half == 1 and col == 0:
                acc = a2
            if half == 1 and col == 1:
                acc = a3
            y = tl.sum(tl.reshape(acc, [WARPS, 32]), axis=0)[None, :]  # every warp's blocks
            if HAS_BIAS:
                y += tl.load(b_ptr + r, mask=ok, other=0.0).to(tl.float32)
            n = 2 * q + col
            # each warp stores the same sums; warp 0's lanes do
            first = tl.arange(0, WARPS)[:, None] == 0
            tl.store(out_ptr + n * som + r, tl.broadcast_to(y, [WARPS, 32]).to(out_ptr.dtype.element_ty),
                     mask=first & ok & (n < T))  # fmt: skip
