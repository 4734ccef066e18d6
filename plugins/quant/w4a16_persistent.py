"""The W4A16 decode GEMV with resident programs (tactics with `persist`: programs per SM).

The plain GEMV (`triton_w4a16._w4a16_gemv_kernel`) launches one program per BLOCK_N weight
rows, and each program walks its rows' K in a handful of chunks (2 at K = 4,096 with 16
blocks a chunk): it loads a chunk, waits the whole DRAM latency for it, computes, loads the
next. Its latency is hidden only by the other programs resident on the SM, and every program
pays its launch, ramp and final reduction. On the H100 and the H200 the gate_up GEMV took
about the same time (30.3 / 27.2 us) though the H200 copies 1.4x faster: latency and issue,
not bandwidth, bound it.

Here the grid is `persist` programs per SM (at most one per tile), and each program walks the
(tile, chunk) steps of tiles pid, pid + programs, ...: one flattened loop whose step i loads
step i + 1's words and scales before computing step i's, so every warp has a chunk in flight
while it computes (registers hold two chunks), and a tile's reduction and store overlap the
next tile's loads. The loop body holds one chunk's code (the plain kernel peels its first
chunk under PDL, two copies). Same arithmetic as the plain kernel, chunk by chunk, so the
same bits (fp32 or PACKED loop, GATED, NORM, ADD_OUT, PDL as `triton_w4a16.w4a16_rows`).
N must be a multiple of BLOCK_N (the launcher runs the plain kernel otherwise): the loads
carry no row masks, and the prefetch past a program's last step reads tile 0's first chunk
(from L2: every program reads it there) instead of a masked, zero-filled load each step.
On the H100 (2026-12-05, `scripts/bench_w4a16.py`, L2 flushed) `_p_r8` was the fastest
decode tactic at o (7.3 us, packed 8.0) and gate_up (28.1 us, 72% of the copy bandwidth; packed
30.4), not at qkv or down; the build times them per site. (The same design for the BF16 and
FP8 GEMVs was 5-15% slower than their plain kernels at every site there and was removed.)
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..gemm.cuda import norm_scale
from ..pdl import pdl_begin
from .triton_w4a16 import _chunk, _gemv_ptrs, _gemv_store


@triton.jit
def _load_step(qw_ptr, s_ptr, w_rows, s_rows, tile, g0, KB, rw, rs, live, S_PER: tl.constexpr,
               BLOCKS_PER_GROUP: tl.constexpr, BLOCK_N: tl.constexpr,
               MASKED: tl.constexpr):  # fmt: skip
    """`triton_w4a16._load_chunk` for chunk g0 of `tile` (N is a multiple of BLOCK_N: no row
    past N). The tile's offset is a scalar, its rows' offsets (w_rows, s_rows) the same for
    every tile. Not `live` (the step after a program's last), it reads tile 0's first chunk,
    which every program reads there, from L2: no mask, so no zeroed registers a step."""
    first = tile.to(tl.int64) * BLOCK_N * live
    g0 = g0 * live
    w_at = qw_ptr + first * (KB * 16) + g0 * 16 + w_rows + rw
    s_at = s_ptr + first * (KB // BLOCKS_PER_GROUP) + g0 // BLOCKS_PER_GROUP + s_rows
    s_at += rs // (S_PER * BLOCKS_PER_GROUP)
    if MASKED:  # the last chunk is partial
        words = tl.load(w_at, mask=(g0 * 16 + rw) < KB * 16, eviction_policy="evict_first")
        sc = tl.load(s_at, mask=(g0 * S_PER + rs) < KB * S_PER, other=0.0)
    else:
        words = tl.load(w_at, eviction_policy="evict_first")
        sc = tl.load(s_at)
    return words, sc


@triton.jit
def _advance(c, tile, chunks, nprog):
    """The step after (chunk c, tile): the tile's next chunk, or the next tile's first."""
    last = c + 1 == chunks
    return tl.where(last, 0, c + 1), tl.where(last, tile + nprog, tile)


@triton.jit
def _w4a16_gemv_persistent_kernel(
    x_ptr, qw_ptr, s_ptr, pqs_ptr, b_ptr, out_ptr, T, N, KB, sxm, som, magic, magic2, c136,
    HAS_PQS: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCKS_PER_GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_G: tl.constexpr, MASKED: tl.constexpr,
    GATED: tl.constexpr = False, PDL: tl.constexpr = False, NORM: tl.constexpr = False,
    wn_ptr=None, ss_ptr=None, eps=0.0, ADD_OUT: tl.constexpr = False, sums_ptr=None, sss=0,
    PACKED: tl.constexpr = False,
):  # fmt: skip
    """`triton_w4a16._w4a16_gemv_kernel`'s contract, on a grid of at most cdiv(N, BLOCK_N)
    programs, each taking tiles pid, pid + programs, ... (module docstring). The steps go in
    pairs with two register sets, A and B, each loaded a step ahead of its use (no copies
    between them, as a loop-carried prefetch would need)."""
    BKW: tl.constexpr = BLOCK_G * 16  # words per row per chunk
    S_PER: tl.constexpr = 4 if PACKED else 16  # words a scale is loaded for
    rw = tl.arange(0, BKW)[None, None, :]
    rs = tl.arange(0, BLOCK_G * S_PER)[None, None, :]
    rows = tl.arange(0, BLOCK_N)
    tile, nprog = tl.program_id(0), tl.num_programs(0)
    chunks = tl.cdiv(KB, BLOCK_G)
    # >= 1 tile each (the grid is at most the tiles)
    steps = tl.cdiv(tl.cdiv(N, BLOCK_N) - tile, nprog) * chunks
    # weights and scales never change during a forward pass: loaded before the PDL wait
    w_rows = rows[None, :, None] * (KB * 16)  # int32: the launcher checks the words fit
    s_rows = rows[None, :, None] * (KB // BLOCKS_PER_GROUP)
    a_words, a_sc = _load_step(qw_ptr, s_ptr, w_rows, s_rows, tile, 0, KB, rw, rs, 1, S_PER,
                               BLOCKS_PER_GROUP, BLOCK_N, MASKED)  # fmt: skip
    pdl_begin(PDL)
    # x's side (the same for every tile; the first tile's weight pointers go unused)
    _, _, rm, mm, rm_c, _, x_ptrs, p_ptrs, n_ptrs = _gemv_ptrs(
        x_ptr, qw_ptr, pqs_ptr, wn_ptr, rows, T, N, KB, sxm, rw, BLOCK_M, NORM
    )
    rstd = norm_scale(ss_ptr, rm_c, sss, KB * 128, eps, NORM, BLOCK_M)[:, None, None]
    acc = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_G * S_PER], tl.float32)
    c = 0
    for i in range(0, steps, 2):
        c1, tile1 = _advance(c, tile, chunks, nprog)  # step i + 1 (B)
        b_words, b_sc = _load_step(qw_ptr, s_ptr, w_rows, s_rows, tile1, c1 * BLOCK_G, KB, rw, rs,
                                   (i + 1 < steps).to(tl.int32), S_PER, BLOCKS_PER_GROUP, BLOCK_N,
                                   MASKED)  # fmt: skip
        acc = _step(a_words, a_sc, acc, c, tile, chunks, True, x_ptrs, p_ptrs, n_ptrs, rows, rw,
                    b_ptr, out_ptr, som, rm, mm, sums_ptr, sss, N, KB, rstd, magic, magic2, c136,
                    HAS_PQS, HAS_BIAS, ADD_OUT, BLOCK_M, BLOCK_N, BLOCK_G, MASKED, GATED, PACKED,
                    NORM)  # fmt: skip
        c, tile = _advance(c1, tile1, chunks, nprog)  # step i + 2 (A)
        a_words, a_sc = _load_step(qw_ptr, s_ptr, w_rows, s_rows, tile, c * BLOCK_G, KB, rw, rs,
                                   (i + 2 < steps).to(tl.int32), S_PER, BLOCKS_PER_GROUP, BLOCK_N,
                                   MASKED)  # fmt: skip
        # past the last step (an odd count), B is `_load_step`'s stand-in: summed, never stored
        acc = _step(b_words, b_sc, acc, c1, tile1, chunks, i + 1 < steps, x_ptrs, p_ptrs, n_ptrs,
                    rows, rw, b_ptr, out_ptr, som, rm, mm, sums_ptr, sss, N, KB, rstd, magic,
                    magic2, c136, HAS_PQS, HAS_BIAS, ADD_OUT, BLOCK_M, BLOCK_N, BLOCK_G, MASKED,
                    GATED, PACKED, NORM)  # fmt: skip


@triton.jit
def _step(words, sc, acc, c, tile, chunks, live, x_ptrs, p_ptrs, n_ptrs, rows, rw, b_ptr, out_ptr,
          som, rm, mm, sums_ptr, sss, N, KB, rstd, magic, magic2, c136, HAS_PQS: tl.constexpr,
          HAS_BIAS: tl.constexpr, ADD_OUT: tl.constexpr, BLOCK_M: tl.constexpr,
          BLOCK_N: tl.constexpr, BLOCK_G: tl.constexpr, MASKED: tl.constexpr,
          GATED: tl.constexpr, PACKED: tl.constexpr, NORM: tl.constexpr):  # fmt: skip
    """acc plus chunk c of `tile` (its words and scales loaded); after the tile's last chunk
    the rows are stored (if live) and acc starts again from zero."""
    acc += _chunk(words, sc, x_ptrs, p_ptrs, n_ptrs, c * BLOCK_G, rw, KB, rstd, magic, magic2,
                  c136, HAS_PQS, BLOCK_M, BLOCK_N, BLOCK_G * 16, MASKED, GATED, PACKED,
                  NORM)  # fmt: skip
    if c + 1 == chunks:
        if live:
            rn = tile * BLOCK_N + rows
            nm = rn < N
            _gemv_store(tl.sum(acc, axis=2), b_ptr, out_ptr, som, rn, nm, tl.where(nm, rn, 0),
                        rm, mm, sums_ptr, sss, HAS_BIAS, ADD_OUT)  # fmt: skip
        acc = tl.zeros_like(acc)
    return acc
