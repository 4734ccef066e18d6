"""The BF16 / FP8 decode GEMV with resident programs (GEMV tactics with `persist`: programs per
SM), as `plugins/quant/w4a16_persistent.py` does it for INT4.

The plain GEMV (`cuda._gemv_kernel`) launches one program per BLOCK_N rows (2,048 programs at
N = 4,096 with two rows each), each loading a chunk, waiting a DRAM round trip for it and
computing, one to seven times; its latency is hidden only by the other programs on the SM.
Here `persist` programs per SM walk the (tile, chunk) steps of tiles pid, pid + programs, ...
in pairs, with two register sets each loaded a step ahead, so a program always has a chunk in
flight while it computes, and a tile's reduction and store overlap the next tile's loads.
Same arithmetic, chunk by chunk, as the plain kernel (`cuda._gemv_fma`): the same bits, with
GATED, SCALED / QUANT_X (FP8), NORM / ADD_OUT (folded norms) and PDL (the first chunk loaded
before the wait). Taken when N is a multiple of BLOCK_N and K of BLOCK_K (every Llama, Mistral
and Qwen shape); the launcher runs the plain kernel otherwise. Not timed on a GPU yet: the
build times these tactics beside the plain ones per site.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..pdl import pdl_begin
from .cuda import _gemv_fma, norm_scale, store_add_out


@triton.jit
def _advance(c, tile, chunks, nprog):
    """The step after (chunk c, tile): the tile's next chunk, or the next tile's first."""
    last = c + 1 == chunks
    return tl.where(last, 0, c + 1), tl.where(last, tile + nprog, tile)


@triton.jit
def _load_step(w_ptr, w_rows, tile, c, swn, live, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Chunk c of `tile` (its rows' offsets w_rows are every tile's). Not `live` (the step
    after a program's last) it reads tile 0's first chunk, which every program read: from
    L2, and no mask (so no zero-filled registers) a step."""
    first = tile.to(tl.int64) * BLOCK_N * live
    return tl.load(w_ptr + first * swn + c * BLOCK_K * live + w_rows,
                   eviction_policy="evict_first")  # fmt: skip


@triton.jit
def _gemv_persistent_kernel(
    x_ptr, w_ptr, b_ptr, sx_ptr, sw_ptr, out_ptr, T, N, K_v, sxm_v, swn_v, som,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, VEC: tl.constexpr, GATED: tl.constexpr = False,
    SCALED: tl.constexpr = False, PDL: tl.constexpr = False, QUANT_X: tl.constexpr = False,
    NORM: tl.constexpr = False, wn_ptr=None, ss_ptr=None, eps=0.0,
    ADD_OUT: tl.constexpr = False, sums_ptr=None, sss=0,
):  # fmt: skip
    """`cuda._gemv_kernel`'s contract on a grid of at most cdiv(N, BLOCK_N) programs, each
    taking tiles pid, pid + programs, ...; N a multiple of BLOCK_N, K of BLOCK_K."""
    K, sxm, swn = K_v * VEC, sxm_v * VEC, swn_v * VEC
    tile, nprog = tl.program_id(0), tl.num_programs(0)
    chunks = K // BLOCK_K
    steps = tl.cdiv(tl.cdiv(N, BLOCK_N) - tile, nprog) * chunks  # >= 1 tile each
    rows = tl.arange(0, BLOCK_N)
    w_rows = rows[:, None] * swn + tl.arange(0, BLOCK_K)[None, :]  # int32: checked at launch
    # weights never change during a forward pass: the first chunk is loaded before the wait
    a_w = _load_step(w_ptr, w_rows, tile, 0, swn, 1, BLOCK_N, BLOCK_K)
    pdl_begin(PDL)
    rm = tl.arange(0, BLOCK_M)
    mm = rm < T
    rm_c = tl.where(mm, rm, 0)  # rows of x past T re-read row 0; masked at the store
    x_ptrs = x_ptr + rm_c[:, None] * sxm + tl.arange(0, BLOCK_K)[None, :]
    sx = 1.0
    sw = 1.0
    if SCALED:
        sx = tl.load(sx_ptr)
        sw = tl.load(sw_ptr)
    rstd = norm_scale(ss_ptr, rm_c, sss, K, eps, NORM, BLOCK_M)
    acc = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K // VEC], tl.float32)
    c = 0
    for i in range(0, steps, 2):
        c1, tile1 = _advance(c, tile, chunks, nprog)  # step i + 1 (B)
        b_w = _load_step(w_ptr, w_rows, tile1, c1, swn, (i + 1 < steps).to(tl.int32), BLOCK_N,
                         BLOCK_K)  # fmt: skip
        acc = _step(a_w, acc, c, tile, chunks, True, x_ptrs, b_ptr, out_ptr, som, rows, rm, mm, N, K,
                    sx, sw, rstd, wn_ptr, sums_ptr, sss, HAS_BIAS, BLOCK_M, BLOCK_N, BLOCK_K,
                    VEC, GATED, SCALED, QUANT_X, NORM, ADD_OUT)  # fmt: skip
        c, tile = _advance(c1, tile1, chunks, nprog)  # step i + 2 (A)
        a_w = _load_step(w_ptr, w_rows, tile, c, swn, (i + 2 < steps).to(tl.int32), BLOCK_N,
                         BLOCK_K)  # fmt: skip
        # past the last step (an odd count), B is `_load_step`'s stand-in: summed, never stored
        acc = _step(b_w, acc, c1, tile1, chunks, i + 1 < steps, x_ptrs, b_ptr, out_ptr, som, rows,
                    rm, mm, N, K, sx, sw, rstd, wn_ptr, sums_ptr, sss, HAS_BIAS, BLOCK_M, BLOCK_N,
                    BLOCK_K, VEC, GATED, SCALED, QUANT_X, NORM, ADD_OUT)  # fmt: skip


@triton.jit
def _step(wt, acc, c, tile, chunks, live, x_ptrs, b_ptr, out_ptr, som, rows, rm, mm, N, K, sx, sw,
          rstd, wn_ptr, sums_ptr, sss, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
          BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, VEC: tl.constexpr, GATED: tl.constexpr,
          SCALED: tl.constexpr, QUANT_X: tl.constexpr, NORM: tl.constexpr,
          ADD_OUT: tl.constexpr):  # fmt: skip
    """acc plus chunk c of `tile` (wt, loaded); after the tile's last chunk its rows are
    stored (if live), as `cuda._gemv_kernel`'s epilogue, and acc starts again from zero."""
    acc = _gemv_fma(acc, wt, x_ptrs, c * BLOCK_K, K, sx, False, BLOCK_M, BLOCK_N, BLOCK_K, VEC,
                    GATED, QUANT_X, NORM, wn_ptr, rstd)  # fmt: skip
    if c + 1 == chunks:
        if live:
            y = tl.sum(acc, axis=2)
            if SCALED:
                y = y * (sx * sw)
            rn = tile * BLOCK_N + rows
            if HAS_BIAS:
                y += tl.load(b_ptr + rn).to(tl.float32)[None, :]
            o_ptrs = out_ptr + rm[:, None] * som + rn[None, :]
            om = mm[:, None] & (rn < N)[None, :]
            if ADD_OUT:
                store_add_out(y, out_ptr, o_ptrs, om, rm, mm, sums_ptr, sss)
            else:
                tl.store(o_ptrs, y.to(out_ptr.dtype.element_ty), mask=om)
        acc = tl.zeros_like(acc)
    return acc
