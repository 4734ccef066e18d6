"""W4A16 GEMM (INT4 AWQ, symmetric, group size a multiple of 128) in Triton (plugin w4a16_gemm
v2); same contract as `reference.w4a16_linear`, reading the engine layout (docs/formats.md):

  qweight [N, K/8] int32, each row in blocks of 128 k: word c of a block holds the codes of
      k = 16j + c in nibble j (low first); scales [N, K/G] in the model dtype;
  pre_quant_scale [K] (AWQ's activation scale) or None.

Chosen by the number of rows T of x and the tactic:

* GEMV (T <= the tactic's `max_m`: decode): a weight stream, laid out as the BF16 GEMV's
  (plugins/gemm/cuda.py): each program owns BLOCK_N weight rows and walks K in chunks of
  BLOCK_G blocks, every thread loading 16 contiguous bytes (4 words, 32 weights) per row, so
  warps read whole 512-byte runs of a row and N / BLOCK_N programs keep 132 SMs busy with no
  split-K (one launch, no workspace). Codes become floats through their bits, masked in place
  (`_nibble_minus_8`: one LOP3 and one FFMA give code - 8 exactly). With the interleaved
  layout the activations of nibble j of a thread's 4 words are 4 consecutive values, one
  vector load shared by the thread's BLOCK_N rows. Three instructions per weight (LOP3, FFMA,
  FFMA), which matters: at 4 bits a weight, a bandwidth-bound GEMV on the H200 leaves ~3.5
  issue slots per weight (sm_90 SASS: ~5.8-6.8 per weight in all, with address arithmetic and
  the final reduction). The block's scale multiplies each word's sum.
* packed GEMV (the same kernel, PACKED; tactics named `..._p`, bf16 x only): in bf16x2
  arithmetic with inline PTX (`_packed_quad`): two codes a LOP3 and a subtraction, two
  products a multiply-add, each half word's 4 products summed in bf16 and the rest in fp32, one scale
  per thread's 4 words. Its K loop is 2.9 sm_90 instructions per weight against 4.4
  (`scripts/sass_w4a16.py`); the build times both kinds.
* GEMM (larger T): tiles of BLOCK_M rows; each K chunk is unpacked, put back in k order,
  dequantized to the model dtype and multiplied with `tl.dot` (tensor cores), fp32
  accumulator; fp32 activations use IEEE dots. NOTE: on the H200 this path is 1.5-1.8x slower
  than v1's (which read [K/8, N] tiles with no reorder); gathering x in word order instead of
  reordering the weights was 3-6x slower still, and x put in word order by a copy before the
  kernel (no reorder inside) 5-15% slower: the reorder is not the cost; v2's 64-byte row
  segments per 128-k chunk are the suspect (docs/performance.md, 2026-12-04 16:20).
* dequantize, then cuBLAS (`DEQUANT_GEMM`, from its min_rows rows): the weight expanded to
  the model dtype into a transient buffer by `_w4_dequant_kernel`, then one cuBLAS GEMM; or
  (`DEQUANT_CHUNKED`) a slab of rows at a time into one reused 8 or 16 MiB buffer, which the
  slab's GEMM reads back from L2.

The activation is scaled by pre_quant_scale in the model dtype (rounded once, as the
reference does) when it is loaded. `gated=True` (the MLP's down projection) passes [gate | up]:
the GEMVs compute silu(gate) * up as they load x, rounded as the SwiGLU kernel rounds it (one
launch fewer per layer at decode sizes); the GEMM path runs the SwiGLU kernel first. Zero points (asymmetric), group sizes that are not a
multiple of 128, or other layouts fall back to the reference in the same call (torch ops on
the same device).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ..gemm.cuda import norm_args, norm_scale, store_add_out
from ..gemm.fused_norm import AddOut, NormIn, add_output, normed_input
from ..pdl import launch_options, pdl_begin
from ..registry import Tactic
from .reference import W4_BLOCK
from .reference import w4a16_linear as _reference
from .w4a16_tactics import (  # noqa: F401 (re-exported: tests and scripts read them here)
    DECODE_TACTICS,
    DEQUANT_CHUNKED,
    DEQUANT_GEMM,
    GEMM_TACTICS,
    MID_ROWS,
    MID_TACTICS,
    MID_TIMED_ROWS,
    SMALL_TACTICS,
    W4A16_TACTICS,
    combine_tactics,
    decode_candidates,
    swiglu_apart,
)

# Triton's interpreter runs the kernels on CPU tensors (the CPU tests of the GPU paths)
_KERNEL_DEVICES = ("cuda", "meta") + (("cpu",) if os.environ.get("TRITON_INTERPRET") == "1" else ())
_MAGIC = 0x4B000000  # the bits of 2^23 in fp32
_MAGIC_BF16X2 = 0x43004300  # 128.0 in both halves of a bf16x2 register
_C136_BF16X2 = 0x43084308  # 136.0 (128 + 8) in both halves
# the interpreter cannot run inline PTX, and its float -> bf16 cast truncates
_INTERPRET = tl.constexpr(os.environ.get("TRITON_INTERPRET") == "1")
assert W4_BLOCK == 128  # the kernels spell the interleaved block as 128 k (16 words)


@triton.jit
def _nibble_minus_8(words, j: tl.constexpr, magic):
    """code - 8 in fp32 for the 4-bit code in bits 4j .. 4j+3 of int32 `words` (j < 5), with no
    shift and no int -> float conversion (a quarter of the FP32 rate on the GPU): the code is
    masked in place into the mantissa of 2^23 (f = 2^23 + code * 16^j, exact, read as fp32),
    then f * 16^-j - (2^23 * 16^-j + 8) is one FFMA (FADD for j = 0) whose exact result,
    code - 8, is representable: no rounding. `magic` is 0x4B000000 passed at run time: as a
    register, (words & mask) | magic is one LOP3 (with two immediates it took two)."""
    f = ((words & (0xF << (4 * j))) | magic).to(tl.float32, bitcast=True)
    if j == 0:
        return f - 8388616.0
    return tl.fma(f, 1.0 / (1 << (4 * j)), -(8388608.0 / (1 << (4 * j)) + 8.0))


@triton.jit
def _times_pqs(x, p):
    """x * pre_quant_scale in x's dtype (one rounding, as the reference), as fp32."""
    p = p.to(x.dtype).to(tl.float32)
    return (x.to(tl.float32) * p).to(x.dtype).to(tl.float32)


@triton.jit
def _x_nibble(x_ptrs, p_ptrs, n_ptrs, j: tl.constexpr, mask, up, rstd, HAS_PQS: tl.constexpr,
              MASKED: tl.constexpr, GATED: tl.constexpr, NORM: tl.constexpr):  # fmt: skip
    """The activations that meet nibble j of the loaded words, in fp32; with HAS_PQS,
    x * pre_quant_scale rounded to x's dtype first, as the reference does. GATED: x rows are
    [gate | up] (`up` elements apart) and x = silu(gate) * up, in fp32 rounded once to the
    model dtype, as the SwiGLU kernel writes it. NORM: x rows are the residual stream,
    RMSNorm-ed as the add + RMSNorm kernel would (rstd [BM, 1, 1], the norm weight at n_ptrs;
    plugins/gemm/fused_norm.py)."""
    if MASKED:
        xj = tl.load(x_ptrs + 16 * j, mask=mask, other=0.0)
    else:
        xj = tl.load(x_ptrs + 16 * j)
    if NORM:
        if MASKED:
            wn = tl.load(n_ptrs + 16 * j, mask=mask, other=0.0)
        else:
            wn = tl.load(n_ptrs + 16 * j)
        h = (xj.to(tl.float32) * rstd).to(xj.dtype)
        xj = (h.to(tl.float32) * wn.to(tl.float32)).to(xj.dtype)
    if GATED:
        if MASKED:
            uj = tl.load(x_ptrs + up + 16 * j, mask=mask, other=0.0)
        else:
            uj = tl.load(x_ptrs + up + 16 * j)
        g = xj.to(tl.float32)
        xj = (g / (1.0 + tl.exp(-g)) * uj.to(tl.float32)).to(xj.dtype)
    if HAS_PQS:
        if MASKED:
            p = tl.load(p_ptrs + 16 * j, mask=mask, other=0.0)
        else:
            p = tl.load(p_ptrs + 16 * j)
        return _times_pqs(xj, p)
    return xj.to(tl.float32)


@triton.jit
def _x_pair(x_ptrs, p_ptrs, n_ptrs, j: tl.constexpr, mask, up, rstd, HAS_PQS: tl.constexpr,
            MASKED: tl.constexpr, GATED: tl.constexpr, NORM: tl.constexpr):  # fmt: skip
    """The bf16 activations that meet nibbles j and j + 4 of the loaded words, packed as one
    bf16x2 word (nibble j's in the low half), as the packed dot's registers hold its weights."""
    lo = _x_nibble(x_ptrs, p_ptrs, n_ptrs, j, mask, up, rstd, HAS_PQS, MASKED, GATED, NORM)
    hi = _x_nibble(x_ptrs, p_ptrs, n_ptrs, j + 4, mask, up, rstd, HAS_PQS, MASKED, GATED, NORM)
    lo, hi = lo.to(tl.bfloat16), hi.to(tl.bfloat16)  # exact: bf16 values
    lo = lo.to(tl.uint16, bitcast=True).to(tl.uint32)
    return lo | (hi.to(tl.uint16, bitcast=True).to(tl.uint32) << 16)


@triton.jit
def _bf16_rne(y):
    """fp32 y rounded to the nearest bf16 (ties to even), as fp32: the bf16x2 instructions'
    rounding, for the interpreter (whose cast to bf16 truncates)."""
    b = y.to(tl.int32, bitcast=True)
    b = (b + (0x7FFF + ((b >> 16) & 1))) & -0x10000
    return b.to(tl.float32, bitcast=True)


@triton.jit
def _packed_half_emulated(words, xp0, xp1, xp2, xp3, HI: tl.constexpr, magic):
    """One half word of `_packed_quad` in fp32, rounded to bf16 after each step as the PTX's
    bf16x2 instructions round (code - 8 and each product are exact; each sum is rounded once,
    as an fma's)."""
    half = words
    if HI:
        half = words >> 16
        xs0, xs1, xs2, xs3 = xp0 >> 16, xp1 >> 16, xp2 >> 16, xp3 >> 16
    else:
        xs0, xs1, xs2, xs3 = xp0 & 0xFFFF, xp1 & 0xFFFF, xp2 & 0xFFFF, xp3 & 0xFFFF
    x0 = (xs0 << 16).to(tl.float32, bitcast=True)
    x1 = (xs1 << 16).to(tl.float32, bitcast=True)
    x2 = (xs2 << 16).to(tl.float32, bitcast=True)
    x3 = (xs3 << 16).to(tl.float32, bitcast=True)
    a = _bf16_rne(_nibble_minus_8(half, 0, magic) * x0)
    a = _bf16_rne(_nibble_minus_8(half, 1, magic) * x1 + a)
    a = _bf16_rne(_nibble_minus_8(half, 2, magic) * x2 + a)
    return _bf16_rne(_nibble_minus_8(half, 3, magic) * x3 + a)


@triton.jit
def _word_emulated(words, xp0, xp1, xp2, xp3, magic):
    lo = _packed_half_emulated(words, xp0, xp1, xp2, xp3, False, magic)
    return lo + _packed_half_emulated(words, xp0, xp1, xp2, xp3, True, magic)


def _quad_ptx() -> str:
    """`_packed_quad`'s PTX. Operands: $0 the fp32 sum; $1-$4 four words; $(5 + 4w + j) the x
    pair of word w's nibbles j and j + 4; $21 128.0 and $22 136.0 in both bf16 halves."""
    out = ["{", ".reg .b32 s1, s2, s3, v0, v1, v2, v3, a, lo, hi;", ".reg .f32 t<4>, u<2>;"]
    for w in range(4):
        word, xs = f"${1 + w}", [f"${5 + 4 * w + j}" for j in range(4)]
        out += [f"shr.u32 s{i}, {word}, {4 * i};" for i in (1, 2, 3)]
        for i, src in enumerate((word, "s1", "s2", "s3")):  # (a & b) | c: LUT 0xEA
            out.append(f"lop3.b32 v{i}, {src}, 0x000F000F, $21, 0xEA;")
        out += [f"sub.rn.bf16x2 v{i}, v{i}, $22;" for i in range(4)]
        out.append(f"mul.rn.bf16x2 a, v0, {xs[0]};")
        out += [f"fma.rn.bf16x2 a, v{i}, {xs[i]}, a;" for i in (1, 2, 3)]
        out += ["shl.b32 lo, a, 16;", "and.b32 hi, a, 0xFFFF0000;", f"add.f32 t{w}, lo, hi;"]
    out += ["add.f32 u0, t0, t1;", "add.f32 u1, t2, t3;", "add.f32 $0, u0, u1;", "}"]
    return "\n".join(out)


_QUAD_PTX = tl.constexpr(_quad_ptx())


@triton.jit
def _quarters(t):
    """[A, B, C] -> the elements 4i, 4i + 1, 4i + 2, 4i + 3 of the last axis, four [A, B, C/4]
    tensors (a thread's 16-byte vector apart, in registers)."""
    r = tl.reshape(t, [t.shape[0], t.shape[1], t.shape[2] // 4, 2, 2])
    even, odd = tl.split(r)
    q0, q2 = tl.split(even)
    q1, q3 = tl.split(odd)
    return q0, q1, q2, q3


@triton.jit
def _packed_quad(words, xp0, xp1, xp2, xp3, magic2, c136, magic):
    """For each 4 consecutive int32 words (a thread's 16-byte load, all in one 128-k block, so
    under one scale), sum over their 32 codes u of (u - 8) * x, in bf16x2 arithmetic: per word
    3 shifts, 4 LOP3 (a code pair masked into the mantissas of 128.0 and 128.0: 128 + u,
    exact), 4 bf16x2 subtractions of 136 (u - 8, exact), a bf16x2 multiply and 3 fmas with the
    x pairs (xp_j: the activations of nibbles j and j + 4; each sum rounded to bf16), and the
    two halves widened and added in fp32: ~19 instructions for 8 weights, where the fp32 path
    takes ~35. words [M, N, C], xp_j [M, 1, C] -> [M, N, C/4] fp32. Each half word's sum of 4
    products is rounded to bf16 (relative error ~2^-9); the rest is added in fp32."""
    w0, w1, w2, w3 = _quarters(words)
    a0, a1, a2, a3 = _quarters(xp0)
    b0, b1, b2, b3 = _quarters(xp1)
    c0, c1, c2, c3 = _quarters(xp2)
    d0, d1, d2, d3 = _quarters(xp3)
    if _INTERPRET:
        t0 = _word_emulated(w0, a0, b0, c0, d0, magic)
        t1 = _word_emulated(w1, a1, b1, c1, d1, magic)
        t2 = _word_emulated(w2, a2, b2, c2, d2, magic)
        t3 = _word_emulated(w3, a3, b3, c3, d3, magic)
        return (t0 + t1) + (t2 + t3)
    args = [w0, w1, w2, w3, a0, b0, c0, d0, a1, b1, c1, d1, a2, b2, c2, d2, a3, b3, c3, d3]
    return tl.inline_asm_elementwise(
        asm=_QUAD_PTX,
        constraints="=f" + ",r" * 22,
        args=args + [magic2, c136],
        dtype=tl.float32,
        is_pure=True,
        pack=1,
    )


@triton.jit
def _gemv_ptrs(x_ptr, qw_ptr, pqs_ptr, wn_ptr, rn, T, N, KB, sxm, rw, BLOCK_M: tl.constexpr,
               NORM: tl.constexpr):  # fmt: skip
    """For weight rows rn (in range nm, clamped rn_c: rows past N re-read row 0 and are masked
    at the store) and x's rows (rm, mm; clamped rm_c): the first chunk's pointers for words
    rw [1, 1, BKW] (weights [1, BN, BKW]; x, pre_quant_scale and NORM's norm weight
    [BM, 1, BKW])."""
    nm = rn < N
    rn_c = tl.where(nm, rn, 0)
    rm = tl.arange(0, BLOCK_M)
    mm = rm < T
    rm_c = tl.where(mm, rm, 0)
    w_ptrs = qw_ptr + rn_c.to(tl.int64)[None, :, None] * (KB * 16) + rw
    x_off = (rw // 16) * 128 + rw % 16  # nibble j of word w meets x[128 (w // 16) + 16 j + w % 16]
    x_ptrs = x_ptr + rm_c[:, None, None] * sxm + x_off
    n_ptrs = x_ptrs  # unused without NORM
    if NORM:
        n_ptrs = wn_ptr + x_off
    return nm, rn_c, rm, mm, rm_c, w_ptrs, x_ptrs, pqs_ptr + x_off, n_ptrs


@triton.jit
def _load_chunk(w_ptrs, s_ptrs, g0, KB, rw, rs, S_PER: tl.constexpr,
                BLOCKS_PER_GROUP: tl.constexpr, MASKED: tl.constexpr):  # fmt: skip
    """The chunk at block g0: its words (streamed once: evicted first) and scales, S_PER
    words a scale (16: one a word; 4: one per thread's 4 words)."""
    if MASKED:
        words = tl.load(w_ptrs + g0 * 16, mask=(g0 * 16 + rw) < KB * 16, other=0,
                        eviction_policy="evict_first")  # fmt: skip
        sc = tl.load(s_ptrs + g0 // BLOCKS_PER_GROUP, mask=(g0 * S_PER + rs) < KB * S_PER,
                     other=0.0)  # fmt: skip
    else:
        words = tl.load(w_ptrs + g0 * 16, eviction_policy="evict_first")
        sc = tl.load(s_ptrs + g0 // BLOCKS_PER_GROUP)
    return words, sc


@triton.jit
def _fp32_chunk(words, sc, xo, po, no, wm, KB, rstd, magic, HAS_PQS: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BKW: tl.constexpr,
                MASKED: tl.constexpr, GATED: tl.constexpr, NORM: tl.constexpr):  # fmt: skip
    """The fp32 loop's chunk -> [BM, BN, BKW]: per word, each nibble's code - 8
    (`_nibble_minus_8`) times its activation in fp32, the block's scale per word's sum."""
    part = tl.zeros([BLOCK_M, BLOCK_N, BKW], tl.float32)
    for h in tl.static_range(2):
        half = words
        if h == 1:
            half = words >> 16  # nibbles 4..7 (the masks below drop the sign bits)
        for j in tl.static_range(4):
            xj = _x_nibble(xo, po, no, 4 * h + j, wm, KB * 128, rstd, HAS_PQS, MASKED, GATED,
                           NORM)  # fmt: skip
            part += xj * _nibble_minus_8(half, j, magic)
    return part * sc.to(tl.float32)


@triton.jit
def _packed_chunk(words, sc, xo, po, no, wm, KB, rstd, magic, magic2, c136,
                  HAS_PQS: tl.constexpr, MASKED: tl.constexpr, GATED: tl.constexpr,
                  NORM: tl.constexpr):  # fmt: skip
    """The packed loop's chunk -> [BM, BN, BKW / 4], in bf16x2 arithmetic (`_packed_quad`):
    the activations of each nibble pair are packed once per chunk (shared by the BLOCK_N
    rows), and a thread's 4 words share one scale, applied once."""
    xp0 = _x_pair(xo, po, no, 0, wm, KB * 128, rstd, HAS_PQS, MASKED, GATED, NORM)
    xp1 = _x_pair(xo, po, no, 1, wm, KB * 128, rstd, HAS_PQS, MASKED, GATED, NORM)
    xp2 = _x_pair(xo, po, no, 2, wm, KB * 128, rstd, HAS_PQS, MASKED, GATED, NORM)
    xp3 = _x_pair(xo, po, no, 3, wm, KB * 128, rstd, HAS_PQS, MASKED, GATED, NORM)
    return _packed_quad(words, xp0, xp1, xp2, xp3, magic2, c136, magic) * sc.to(tl.float32)


@triton.jit
def _chunk(words, sc, x_ptrs, p_ptrs, n_ptrs, g0, rw, KB, rstd, magic, magic2, c136,
           HAS_PQS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
           BKW: tl.constexpr, MASKED: tl.constexpr, GATED: tl.constexpr,
           PACKED: tl.constexpr, NORM: tl.constexpr):  # fmt: skip
    """The chunk at block g0 (words and scales loaded) times x's: the fp32 or PACKED math."""
    wm = (g0 * 16 + rw) < KB * 16
    xo, po, no = x_ptrs + g0 * 128, p_ptrs + g0 * 128, n_ptrs + g0 * 128
    # NOTE: if / else, not an early return: Triton compiled the code after a constexpr
    # branch's return too (the fp32 math on the packed shapes failed to compile)
    if PACKED:
        out = _packed_chunk(words, sc, xo, po, no, wm, KB, rstd, magic, magic2, c136, HAS_PQS,
                            MASKED, GATED, NORM)  # fmt: skip
    else:
        out = _fp32_chunk(words, sc, xo, po, no, wm, KB, rstd, magic, HAS_PQS, BLOCK_M, BLOCK_N,
                          BKW, MASKED, GATED, NORM)  # fmt: skip
    return out


@triton.jit
def w4a16_rows(x_ptr, qw_ptr, s_ptr, pqs_ptr, rn, T, N, KB, sxm, magic, magic2, c136,
               HAS_PQS: tl.constexpr, BLOCKS_PER_GROUP: tl.constexpr, BLOCK_M: tl.constexpr,
               BLOCK_N: tl.constexpr, BLOCK_G: tl.constexpr, MASKED: tl.constexpr,
               STAGES: tl.constexpr, GATED: tl.constexpr, PACKED: tl.constexpr,
               NORM: tl.constexpr, wn_ptr, ss_ptr, sss, eps, PDL: tl.constexpr):  # fmt: skip
    """The W4A16 GEMV of weight rows rn [BLOCK_N] (any rows: the QKV-RoPE kernel takes them
    in RoPE pairs) with x's first T rows -> (sums [BLOCK_M, BLOCK_N] fp32, nm, rn_c, rm, mm):
    `_gemv_ptrs`'s rows, the fp32 or the PACKED loop. The kernels' contract:
    `_w4a16_gemv_kernel`. Waits for the kernel before (PDL) after loading the first chunk's
    words and scales, which never depend on it: they stream in during its tail; x, and NORM's
    sums of squares, are read after the wait. The sums' order is the plain loop's (the same
    bits)."""
    BKW: tl.constexpr = BLOCK_G * 16  # words per row per chunk
    S_PER: tl.constexpr = 4 if PACKED else 16  # words a scale is loaded for
    rw = tl.arange(0, BKW)[None, None, :]  # [1, 1, BKW]: word w of the chunk, block w // 16
    rs = tl.arange(0, BLOCK_G * S_PER)[None, None, :]
    nm, rn_c, rm, mm, rm_c, w_ptrs, x_ptrs, p_ptrs, n_ptrs = _gemv_ptrs(
        x_ptr, qw_ptr, pqs_ptr, wn_ptr, rn, T, N, KB, sxm, rw, BLOCK_M, NORM
    )
    s_ptrs = s_ptr + rn_c.to(tl.int64)[None, :, None] * (KB // BLOCKS_PER_GROUP)
    s_ptrs += rs // (S_PER * BLOCKS_PER_GROUP)
    acc = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_G * S_PER], tl.float32)
    START: tl.constexpr = BLOCK_G if PDL else 0  # where the loop begins
    if PDL:
        words, sc = _load_chunk(w_ptrs, s_ptrs, 0, KB, rw, rs, S_PER, BLOCKS_PER_GROUP, MASKED)
        pdl_begin(PDL)
        rstd = norm_scale(ss_ptr, rm_c, sss, KB * 128, eps, NORM, BLOCK_M)[:, None, None]
        acc += _chunk(words, sc, x_ptrs, p_ptrs, n_ptrs, 0, rw, KB, rstd, magic, magic2, c136,
                      HAS_PQS, BLOCK_M, BLOCK_N, BKW, MASKED, GATED, PACKED, NORM)  # fmt: skip
    else:
        rstd = norm_scale(ss_ptr, rm_c, sss, KB * 128, eps, NORM, BLOCK_M)[:, None, None]
    # NOTE: never a lower bound past the upper one (one chunk is all of K): as gemv_acc
    for g0 in tl.range(START, tl.maximum(KB, START), BLOCK_G, num_stages=STAGES):
        words, sc = _load_chunk(w_ptrs, s_ptrs, g0, KB, rw, rs, S_PER, BLOCKS_PER_GROUP, MASKED)
        acc += _chunk(words, sc, x_ptrs, p_ptrs, n_ptrs, g0, rw, KB, rstd, magic, magic2, c136,
                      HAS_PQS, BLOCK_M, BLOCK_N, BKW, MASKED, GATED, PACKED, NORM)  # fmt: skip
    return tl.sum(acc, axis=2), nm, rn_c, rm, mm


@triton.jit
def _gemv_store(y, b_ptr, out_ptr, som, rn, nm, rn_c, rm, mm, sums_ptr, sss,
                HAS_BIAS: tl.constexpr, ADD_OUT: tl.constexpr):  # fmt: skip
    """out[rm, rn] = y [BM, BN] (+ bias); ADD_OUT: added into out, the residual stream, with
    the rows' sums of squares (fused_norm.py)."""
    if HAS_BIAS:
        y += tl.load(b_ptr + rn_c).to(tl.float32)[None, :]
    o_ptrs = out_ptr + rm.to(tl.int64)[:, None] * som + rn[None, :]
    om = mm[:, None] & nm[None, :]
    if ADD_OUT:
        store_add_out(y, out_ptr, o_ptrs, om, rm, mm, sums_ptr, sss)
    else:
        tl.store(o_ptrs, y.to(out_ptr.dtype.element_ty), mask=om)


@triton.jit
def _w4a16_gemv_kernel(
    x_ptr, qw_ptr, s_ptr, pqs_ptr, b_ptr, out_ptr, T, N, KB, sxm, som, magic, magic2, c136,
    HAS_PQS: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCKS_PER_GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_G: tl.constexpr, MASKED: tl.constexpr,
    STAGES: tl.constexpr, GATED: tl.constexpr = False, PDL: tl.constexpr = False,
    NORM: tl.constexpr = False, wn_ptr=None, ss_ptr=None, eps=0.0,
    ADD_OUT: tl.constexpr = False, sums_ptr=None, sss=0, PACKED: tl.constexpr = False,
):  # fmt: skip
    """out[m, n] = sum_k (x[m, k] * pqs[k]) * (u[n, k] - 8) * scales[n, k // G] (+ b[n]) for
    m < T and this program's BLOCK_N rows; KB = K / 128 blocks per row. Tensors are
    [BLOCK_M, BLOCK_N, BLOCK_G * 16]: x rows, weight rows, words of the chunk.
    MASKED: KB is not a multiple of BLOCK_G (the last chunk is partial). GATED: x rows are
    [gate | up], 2K wide, and x = silu(gate) * up (the MLP's down projection; `_x_nibble`).
    NORM / ADD_OUT: the RMSNorm folded in, as `plugins/gemm/cuda.py:_gemv_kernel` (x is the
    residual stream, normalized as loaded / the output is added into the residual stream).
    PACKED: bf16 x, the bf16x2 loop (`_packed_chunk`; magic2 and c136 its constants)."""
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    y, nm, rn_c, rm, mm = w4a16_rows(
        x_ptr, qw_ptr, s_ptr, pqs_ptr, rn, T, N, KB, sxm, magic, magic2, c136, HAS_PQS,
        BLOCKS_PER_GROUP, BLOCK_M, BLOCK_N, BLOCK_G, MASKED, STAGES, GATED, PACKED, NORM,
        wn_ptr, ss_ptr, sss, eps, PDL,
    )  # fmt: skip
    _gemv_store(y, b_ptr, out_ptr, som, rn, nm, rn_c, rm, mm, sums_ptr, sss, HAS_BIAS, ADD_OUT)


@triton.jit
def _w4_dequant_kernel(qw_ptr, s_ptr, out_ptr, N, KB, BLOCKS_PER_GROUP: tl.constexpr,
                       BLOCK_N: tl.constexpr):  # fmt: skip
    """out[n, 128 b + k] = (u[n, 128 b + k] - 8) * scales[n, b // BLOCKS_PER_GROUP] in out's
    dtype, for this program's BLOCK_N rows and block b (the engine's interleaved words put
    back in k order), as `reference.dequantize_w4` then a cast."""
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    b = tl.program_id(1)
    nm = rn < N
    rn_c = tl.where(nm, rn, 0).to(tl.int64)
    words = tl.load(qw_ptr + rn_c[:, None] * (KB * 16) + b * 16 + tl.arange(0, 16)[None, :])
    codes = (words[:, :, None] >> (tl.arange(0, 8) * 4)[None, None, :]) & 0xF  # [BN, c, j]
    codes = tl.reshape(tl.permute(codes, (0, 2, 1)), [BLOCK_N, 128])  # k = 16 j + c
    sc = tl.load(s_ptr + rn_c * (KB // BLOCKS_PER_GROUP) + b // BLOCKS_PER_GROUP)
    w = (codes - 8).to(tl.float32) * sc.to(tl.float32)[:, None]
    ptrs = out_ptr + rn_c[:, None] * (KB * 128) + b * 128 + tl.arange(0, 128)[None, :]
    tl.store(ptrs, w.to(out_ptr.dtype.element_ty), mask=nm[:, None])


def _dequant_matmul(x, qweight, scales, pqs, group_size, bias, out, params):
    """The DEQUANT_GEMM tactics: the weight expanded to x's dtype (a transient buffer), x
    scaled by pre_quant_scale (rounded in x's dtype, as the reference), one cuBLAS GEMM (fp32
    x: IEEE, TF32 off, as the GEMM plugin's fp32 path) into out; with `chunk_bytes`, a slab of
    rows (a multiple of block_n) at a time, each expanded into one reused buffer."""
    from ..gemm.cuda import _cublas

    N, K = qweight.shape[0], x.shape[1]
    bn = int(params.get("block_n", 32))
    rows = N
    if params.get("chunk_bytes"):
        rows = max(bn, int(params["chunk_bytes"]) // (K * x.element_size()) // bn * bn)
    w = torch.empty((min(rows, N), K), dtype=x.dtype, device=x.device)
    if pqs is not None:
        x = x * pqs.to(x.dtype)
    for n0 in range(0, N, rows):
        n = min(rows, N - n0)
        _w4_dequant_kernel[(triton.cdiv(n, bn), K // W4_BLOCK)](
            qweight[n0:], scales[n0:], w, n, K // W4_BLOCK, BLOCKS_PER_GROUP=group_size // W4_BLOCK,
            BLOCK_N=bn, num_warps=int(params.get("num_warps", 4)), num_stages=1,
        )  # fmt: skip
        b = bias[n0 : n0 + n] if bias is not None else None
        _cublas(x, w[:n], b, out[:, n0 : n0 + n])
    return out


@triton.jit
def _w4a16_mm_kernel(
    x_ptr, qw_ptr, s_ptr, pqs_ptr, b_ptr, out_ptr, T, N, K, sxm, som, magic,
    HAS_PQS: tl.constexpr, HAS_BIAS: tl.constexpr, IEEE: tl.constexpr, GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr,
    PDL: tl.constexpr = False, SPLIT_K: tl.constexpr = 1,
):  # fmt: skip
    """out = (x * pqs) @ dequant(qweight)^T (+ b), [BLOCK_M, BLOCK_N] tiles; K is a multiple
    of BLOCK_K, BLOCK_K of 128 and GROUP of BLOCK_K, so a chunk has one scale per row.
    SPLIT_K > 1: program (m, n, s) sums the s-th of SPLIT_K runs of K's chunks (the last ones
    may be shorter or empty) into out[s] (fp32 [SPLIT_K, T, som], no bias: `_split_k_sum_kernel`)."""
    pdl_begin(PDL)
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    mm = rm < T
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    nm = rn < N
    rn_c = tl.where(nm, rn, 0)
    rk = tl.arange(0, BLOCK_K)
    rw = tl.arange(0, BLOCK_K // 8)
    shifts = tl.arange(0, 8) * 4
    x_rows = x_ptr + rm.to(tl.int64)[:, None] * sxm
    w_rows = qw_ptr + rn_c.to(tl.int64)[:, None] * (K // 8)
    s_rows = s_ptr + rn_c.to(tl.int64) * (K // GROUP)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    k_lo, k_hi = 0, K
    if SPLIT_K > 1:
        per = tl.cdiv(K // BLOCK_K, SPLIT_K) * BLOCK_K
        k_lo = tl.program_id(2) * per
        k_hi = tl.minimum(k_lo + per, K)
        out_ptr += tl.program_id(2).to(tl.int64) * T * som
    for k0 in tl.range(k_lo, k_hi, BLOCK_K, num_stages=STAGES):
        words = tl.load(w_rows + k0 // 8 + rw[None, :])  # [BN, BK/8]
        # [BN, blocks, word c, nibble j] -> k order (block, j, c)
        codes = words[:, :, None] >> shifts[None, None, :]
        codes = tl.reshape(codes, [BLOCK_N, BLOCK_K // 128, 16, 8])
        codes = tl.reshape(tl.permute(codes, (0, 1, 3, 2)), [BLOCK_N, BLOCK_K])
        sc = tl.load(s_rows + k0 // GROUP).to(tl.float32)
        w = _nibble_minus_8(codes, 0, magic) * sc[:, None]  # [BN, BK]
        xk = tl.load(x_rows + (k0 + rk)[None, :], mask=mm[:, None], other=0.0)
        if HAS_PQS:
            xk = _times_pqs(xk, tl.load(pqs_ptr + k0 + rk)[None, :]).to(xk.dtype)
        if IEEE:
            acc = tl.dot(xk, tl.trans(w), acc, input_precision="ieee")
        else:
            acc = tl.dot(xk, tl.trans(w.to(xk.dtype)), acc)
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn_c).to(tl.float32)[None, :]
    o_ptrs = out_ptr + rm.to(tl.int64)[:, None] * som + rn[None, :]
    tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mm[:, None] & nm[None, :])


@triton.jit
def _split_k_sum_kernel(part_ptr, b_ptr, out_ptr, T, N, som, SPLIT_K: tl.constexpr,
                        HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):  # fmt: skip
    """out[m, n] = sum over s in order of part[s, m, n] (+ b[n]), cast to out's dtype; part:
    fp32 [SPLIT_K, T, N] contiguous."""
    pdl_begin(PDL)
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = i < T * N
    acc = tl.zeros([BLOCK], tl.float32)
    for s in tl.static_range(SPLIT_K):
        acc += tl.load(part_ptr + s * T * N + i, mask=ok, other=0.0)
    m, n = i // N, i % N
    if HAS_BIAS:
        acc += tl.load(b_ptr + n, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + m * som + n, acc.to(out_ptr.dtype.element_ty), mask=ok)


def _half_params(tactic: Tactic | None, prefix: str) -> dict:
    """The parameters of one half of a combined tactic (`combine_tactics`), prefix removed."""
    p = tactic.as_dict() if tactic is not None else {}
    return {k[len(prefix) :]: v for k, v in p.items() if k.startswith(prefix)}


def _split_params(tactic: Tactic | None) -> tuple[dict, dict]:
    dec, mm = _half_params(tactic, "dec_"), _half_params(tactic, "mm_")
    return dec or DECODE_TACTICS[0].as_dict(), mm or GEMM_TACTICS[0].as_dict()


def _small_params(tactic: Tactic | None) -> dict:
    """The small-batch half's parameters ({} without one: those rows run the GEMM)."""
    return _half_params(tactic, "sb_")


def _mid_params(tactic: Tactic | None) -> dict:
    """The medium-batch half's parameters ({} without one: those rows run the GEMM)."""
    return _half_params(tactic, "md_")


def kernel_ok(
    x, qweight, scales, pre_quant_scale, group_size, zeros, bias, block_k: int, gated=False
) -> bool:
    """Shapes and layouts the kernels take (any device: the caller decides where it runs);
    block_k: the GEMM path's chunk, which must lie in one group (the GEMV passes 128).
    gated: x is [T, 2K], gate then up (the GEMV applies SwiGLU as it loads them)."""
    K = (x.shape[-1] // (2 if gated else 1)) if x.dim() == 2 else -1
    return (
        x.dim() == 2
        and x.dtype in (torch.bfloat16, torch.float16, torch.float32)
        and x.stride(1) == 1
        and zeros is None
        and K > 0
        and group_size % W4_BLOCK == 0
        and K % group_size == 0
        and group_size % block_k == 0
        and qweight.dtype == torch.int32
        and qweight.dim() == 2
        and qweight.shape[1] * 8 == K
        and qweight.is_contiguous()
        and scales.is_contiguous()
        and tuple(scales.shape) == (qweight.shape[0], K // group_size)
        and (pre_quant_scale is None or pre_quant_scale.is_contiguous())
        and (bias is None or bias.is_contiguous())
    )


def launch_w4a16(
    x, qweight, scales, pre_quant_scale, group_size, bias, out, params, decode, gated=False,
    norm: NormIn | None = None, add: AddOut | None = None,
):  # fmt: skip
    """Run the GEMV (decode) or GEMM kernel with `params` into out [T, N]; checked by kernel_ok.
    GEMV only: gated: x is [T, 2K], gate then up, and the input is silu(gate) * up; norm /
    add: the RMSNorm folded in (`folds_ok`; out is then add.residual)."""
    assert decode or (not gated and norm is None and add is None), "the GEMM path: unfused"
    T, K = x.shape[0], x.shape[1] // (2 if gated else 1)
    N = qweight.shape[0]
    if T == 0 or N == 0:
        return out
    pqs = pre_quant_scale
    if not decode and params.get("dequant"):
        if T >= int(params.get("min_rows", 0)):
            return _dequant_matmul(x, qweight, scales, pqs, group_size, bias, out, params)
        params = GEMM_TACTICS[0].as_dict()  # too few rows to pay for the expansion
    common = dict(HAS_PQS=pqs is not None, HAS_BIAS=bias is not None,
                  num_warps=int(params.get("num_warps", 4)), num_stages=1, **launch_options())  # fmt: skip
    args = (x, qweight, scales, pqs if pqs is not None else scales,
            bias if bias is not None else scales, out, T, N)  # fmt: skip
    stages = int(params.get("num_stages", 2))
    if decode:
        bn, bg, kb = int(params["block_n"]), int(params["block_g"]), K // W4_BLOCK
        packed = bool(params.get("packed", 0)) and x.dtype == torch.bfloat16
        kw = dict(BLOCKS_PER_GROUP=group_size // W4_BLOCK, BLOCK_M=max(1, triton.next_power_of_2(T)),
                  BLOCK_N=bn, BLOCK_G=bg, MASKED=kb % bg != 0, GATED=gated, **common,
                  **norm_args(norm), **add_args(add), **({"PACKED": True} if packed else {}))  # fmt: skip
        args += (kb, x.stride(0), out.stride(0), _MAGIC, _MAGIC_BF16X2, _C136_BF16X2)
        if mma_takes(x, params, gated, norm, add):
            from . import w4a16_mma as wm

            tiles, warps, rows = int(params["tiles"]), int(params["mma_warps"]), mma_rows(params)
            for r0 in range(0, T, rows):  # passes of the rows one launch takes
                wm._w4a16_mma_gemv_kernel[(triton.cdiv(N, 16 * tiles),)](
                    x[r0:], *args[1:5], out[r0:], min(rows, T - r0), N, kb, x.stride(0),
                    out.stride(0), wm.NEG136, wm.MAGIC2, HAS_PQS=pqs is not None,
                    HAS_BIAS=bias is not None, BLOCKS_PER_GROUP=group_size // W4_BLOCK,
                    WARPS=warps, TILES=tiles, UNROLL=int(params["unroll"]),
                    PREFETCH=bool(params.get("prefetch")), XTILES=rows // MMA_ROWS,
                    num_warps=warps, num_stages=1, **launch_options(),
                )  # fmt: skip
        elif params.get("persist") and N % bn == 0 and N * kb * 16 < 2**31:
            from ..resident import resident_grid
            from . import w4a16_persistent as wp

            grid = resident_grid(triton.cdiv(N, bn), int(params["persist"]), x.device)
            wp._w4a16_gemv_persistent_kernel[(grid,)](*args, **kw)
        else:
            _w4a16_gemv_kernel[(triton.cdiv(N, bn),)](*args, STAGES=stages, **kw)
    else:
        bm, bn, bk = int(params["block_m"]), int(params["block_n"]), int(params["block_k"])
        split, dst, extra = int(params.get("split_k", 1)), out, {}
        if split > 1:  # K over `split` programs a tile, tiles of up to block_m rows (as few as
            # T needs): fp32 partial sums into a transient buffer, which _split_k_sum_kernel
            # adds (with the bias) into out
            bm = min(bm, max(16, triton.next_power_of_2(T)))
            dst = torch.empty((split, T, N), dtype=torch.float32, device=x.device)
            extra = dict(SPLIT_K=split, HAS_BIAS=False)
        _w4a16_mm_kernel[(triton.cdiv(T, bm), triton.cdiv(N, bn), split)](
            *args[:5], dst, T, N, K, x.stride(0), dst.stride(-2), _MAGIC,
            IEEE=x.dtype == torch.float32, GROUP=group_size, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
            STAGES=stages, **(common | extra),
        )  # fmt: skip
        if split > 1:
            _split_k_sum_kernel[(triton.cdiv(T * N, 1024),)](
                dst, args[4], out, T, N, out.stride(0), SPLIT_K=split, HAS_BIAS=bias is not None,
                BLOCK=1024, num_warps=4, **launch_options(),
            )  # fmt: skip
    return out


MMA_ROWS = 8  # x rows the tensor-core GEMV takes an x tile (w4a16_mma.py: the MMA's n)


def mma_rows(params: dict) -> int:
    """The x rows one tensor-core GEMV launch of an `mma` tactic takes (8 an x tile)."""
    return MMA_ROWS * int(params.get("xtiles", 1))


def mma_takes(x, params: dict, gated: bool = False, norm=None, add=None) -> bool:
    """Whether a decode call runs the tensor-core GEMV (w4a16_mma.py): an `mma` tactic, bf16
    x, nothing folded in (SwiGLU, when asked, runs before it). More rows than a launch takes
    (`mma_rows`) run in passes; the plugin routes only the rows each half is for."""
    return (
        bool(params.get("mma"))
        and x.dtype == torch.bfloat16
        and not gated
        and norm is None
        and add is None
    )


def add_args(add: AddOut | None) -> dict:
    """The GEMV's ADD_OUT arguments (none without one)."""
    if add is None:
        return {}
    return dict(ADD_OUT=True, sums_ptr=add.sums, sss=add.sums.stride(0))


def folds_ok(x, qweight, norm: NormIn | None, add: AddOut | None) -> bool:
    """The GEMV can take the norm before it (x is then the residual stream) and the residual
    add after it as they are laid out (True without either)."""
    T, N = x.shape[0], qweight.shape[0]
    sums = [f.sums for f in (norm, add) if f is not None]
    return (
        all(s.shape == (2, T) and s.stride(1) == 1 for s in sums)
        and len({s.stride(0) for s in sums}) <= 1  # one `sss` for both
        and (
            norm is None
            or (
                norm.weight.dtype == x.dtype
                and norm.weight.is_contiguous()
                and norm.weight.shape == (x.shape[1],)
            )
        )  # fmt: skip
        and (
            add is None
            or (
                add.residual.dtype == x.dtype
                and add.residual.shape == (T, N)
                and add.residual.stride(1) == 1
            )
        )  # fmt: skip
    )


def make_w4a16_linear(tactic: Tactic | None = None):
    from ..activation.triton_kernels import make_swiglu

    dec, mm = _split_params(tactic)
    small, mid = _small_params(tactic), _mid_params(tactic)
    max_m = int(dec.get("max_m", 1))
    swiglu = make_swiglu(None)

    def w4a16_linear(
        x: torch.Tensor,
        qweight: torch.Tensor,
        scales: torch.Tensor,
        pre_quant_scale: torch.Tensor | None,
        group_size: int,
        zeros: torch.Tensor | None = None,
        bias: torch.Tensor | None = None,
        *,
        out: torch.Tensor | None = None,
        gated: bool = False,
        norm: NormIn | None = None,
        add: AddOut | None = None,
    ) -> torch.Tensor:
        """x: [T, K] -> [T, N] in x.dtype (written into `out` if given). gated: x is [T, 2K]
        (gate, then up) and the input is silu(gate) * up, the MLP's down projection: the GEMV
        applies SwiGLU as it loads x (a launch and a pass over [T, K] fewer); larger T runs
        the SwiGLU kernel, then the GEMM. norm / add: the RMSNorm folded in (fused_norm.py:
        x is the residual stream / the output goes into add.residual, which is returned);
        the GEMV takes them, other calls apply them in torch around the plain GEMM."""
        # the tensor-core GEMV takes up to 8 rows of bf16 x at the cost of one (the MMA's n):
        # small decode batches run it rather than the GEMM, as the decode half (an mma one)
        # or as the small-batch half past the decode half's max_m
        mma_ok = x.dim() == 2 and x.dtype == torch.bfloat16 and norm is None and add is None
        rows = mma_rows(dec) if dec.get("mma") and mma_ok else max_m
        decode = x.dim() == 2 and x.shape[0] <= rows
        params = dec if decode else mm
        if not decode and small and mma_ok and x.shape[0] <= mma_rows(small):
            decode, params = True, small
        elif not decode and mid and x.dim() == 2 and x.shape[0] <= MID_ROWS:
            # medium decode batches: the split-K GEMM, or the tensor-core GEMV in passes
            if not mid.get("mma"):
                params = mid
            elif mma_ok:
                decode, params = True, mid
        block_k = W4_BLOCK if decode else int(params["block_k"])
        args = (qweight, scales, pre_quant_scale, group_size, zeros, bias)
        on_gpu = x.device.type in _KERNEL_DEVICES  # meta: the AOT dry run records the launches
        if on_gpu and gated and not (decode and kernel_ok(x, *args, block_k, gated=True)
                                     and not mma_takes(x[:, : x.shape[1] // 2], params)
                                     and not params.get("swiglu_apart")):  # fmt: skip
            x, gated = swiglu(x), False
        kernel = on_gpu and kernel_ok(x, *args, block_k, gated=gated)
        if not (kernel and decode and folds_ok(x, qweight, norm, add)):
            x = normed_input(x, norm) if norm is not None else x
            norm, add_after, add = None, add, None  # the norm and the add in torch
        else:
            add_after = None
        if not kernel:
            y = _reference(x, *args, gated=gated)
            y = y if out is None or add_after is not None else out.copy_(y)
        else:
            if add is not None:
                out = add.residual
            elif out is None or add_after is not None:
                out = torch.empty((x.shape[0], qweight.shape[0]), dtype=x.dtype, device=x.device)
            y = launch_w4a16(x, qweight, scales, pre_quant_scale, group_size, bias, out, params,
                             decode, gated, norm, add)  # fmt: skip
        return add_output(y, add_after) if add_after is not None else y

    w4a16_linear.gemv_rows = max_m  # the passes its norms may fold into (fused_norm.py)
    return w4a16_linear
