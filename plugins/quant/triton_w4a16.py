"""W4A16 GEMM (INT4 AWQ, symmetric, group size 128) in Triton (plugin w4a16_gemm v1); same
contract as `reference.w4a16_linear`, reading the engine layout (docs/formats.md):

  qweight [K/8, N] int32 (word (r, n): codes of W'[n, 8r .. 8r+7], low nibble first),
  scales [K/G, N] in the model dtype, pre_quant_scale [K] (AWQ's activation scale) or None.

One kernel, two paths chosen by the number of rows T of x:

* decode (T <= the tactic's `max_m`): a weight stream. Each program owns BLOCK_N output
  columns and one of SPLIT_K slices of K, reads every packed word of its slice exactly once
  (4 bits per weight: a quarter of a bf16 GEMV's bytes) and accumulates x @ w with fp32 FMAs
  (no tensor cores: T is tiny). Codes become floats through their bits (no int -> float
  conversions) and a chunk's group scale multiplies its sums, not each weight. At batch 1 the
  chunk is worked in the words' own layout, one nibble position at a time (`_gemv_chunk`);
  a few rows unpack the words into a [BLOCK_K, BLOCK_N] tile. Split-K keeps enough
  programs in flight for N = 4096 on 132 SMs; the slices write fp32 partials and a small
  second kernel sums them, adds the bias and casts (no atomics: deterministic, graph capturable).
* gemm (larger T): tiles of BLOCK_M rows; each K chunk is dequantized to the model dtype and
  multiplied with `tl.dot` (tensor cores), fp32 accumulator; fp32 activations use IEEE dots.

BLOCK_K divides the group size, so a K chunk has one row of scales. The activation is scaled by
pre_quant_scale in the model dtype (rounded once, as the reference does) when it is loaded.
Zero points (asymmetric), other group sizes or layouts fall back to the reference in the same
call (torch ops on the same device).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..pdl import launch_options, pdl_begin
from ..registry import Tactic
from .reference import w4a16_linear as _reference


def _dec(bn: int, bk: int, split: int, w: int, s: int, max_m: int) -> Tactic:
    return Tactic(
        f"dec_n{bn}_k{bk}_sk{split}_w{w}_s{s}_m{max_m}",
        (("block_n", bn), ("block_k", bk), ("split_k", split), ("num_warps", w),
         ("num_stages", s), ("max_m", max_m)),
    )  # fmt: skip


def _mm(bm: int, bn: int, bk: int, w: int, s: int) -> Tactic:
    return Tactic(
        f"mm_m{bm}_n{bn}_k{bk}_w{w}_s{s}",
        (("block_m", bm), ("block_n", bn), ("block_k", bk), ("num_warps", w), ("num_stages", s)),
    )


# NOTE: a build on the GPU times these per use site (compiler/tactic_select.py); the first of
# each is the default when cross-building without a GPU, a guess until the H200 benchmarks
# (scripts/bench_quant.sh) pick better. Decode: BLOCK_N * BLOCK_K * next_pow2(T) fp32
# products per program stay <= 64 registers per thread.
DECODE_TACTICS: tuple[Tactic, ...] = (
    _dec(64, 128, 4, 4, 3, 2),
    _dec(32, 128, 2, 4, 3, 2),
    _dec(64, 128, 8, 4, 3, 1),
    _dec(128, 128, 4, 8, 3, 2),
    _dec(32, 64, 4, 4, 4, 4),
    _dec(64, 64, 4, 4, 4, 4),
    # no split-K: no fp32 partials and no reduce kernel after each of a decode step's 128
    # W4A16 GEMMs, at the price of fewer, narrower programs (timing decides)
    _dec(16, 128, 1, 4, 3, 2),
    _dec(32, 128, 1, 4, 3, 1),
    # NOTE: wider column tiles (128 and 256 columns, each x value serving more of a thread's
    # columns) were never the fastest on the H200 (docs/bench/bench-w4a16.json): these GEMVs
    # are bound by latency and launches, not by the instructions per weight
)
GEMM_TACTICS: tuple[Tactic, ...] = (
    _mm(64, 128, 64, 4, 3),
    _mm(128, 128, 64, 8, 3),
    _mm(32, 64, 128, 4, 3),
    _mm(128, 256, 64, 8, 3),
    _mm(16, 64, 128, 4, 4),
)


def combine_tactics(dec: Tactic, mm: Tactic) -> Tactic:
    params = tuple(("dec_" + k, v) for k, v in dec.params)
    params += tuple(("mm_" + k, v) for k, v in mm.params)
    return Tactic(f"{dec.name}+{mm.name}", params)


W4A16_TACTICS: tuple[Tactic, ...] = tuple(
    [combine_tactics(DECODE_TACTICS[0], m) for m in GEMM_TACTICS]
    + [combine_tactics(d, GEMM_TACTICS[0]) for d in DECODE_TACTICS[1:]]
)


_MAGIC = 0x4B000000  # the bits of 2^23 in fp32


@triton.jit
def _nibble_minus_8(words, j: tl.constexpr, magic):
    """(code - 8) * 16^j in fp32 for the 4-bit code in bits 4j .. 4j+3 of int32 `words`
    (j < 5), with no shift and no int -> float conversion (a quarter of the FP32 rate on the
    GPU; it bounded the decode path): the code is masked in place into the mantissa of 2^23
    (2^23 + code * 16^j, exact, read as fp32), minus 2^23 + 8 * 16^j. `magic` is 0x4B000000
    passed at run time: as a register, (words & mask) | magic is one LOP3 (with two
    immediates it took two)."""
    f = ((words & (0xF << (4 * j))) | magic).to(tl.float32, bitcast=True)
    return f - (8388608.0 + 8.0 * (1 << (4 * j)))


@triton.jit
def _gemv_chunk(words, x_ptr, pqs_ptr, k0, rkw, magic, HAS_PQS: tl.constexpr):
    """One row of x (batch 1) times a chunk of packed words [BLOCK_K/8, BLOCK_N]: partial sums
    per word row, [BLOCK_K/8, BLOCK_N] fp32. Works in the words' own layout (each thread keeps
    its words and reuses an x value across its columns), one nibble position j of each half
    word at a time: `_nibble_minus_8` gives (code - 8) * 16^j without shifting, and x comes
    scaled by 16^-j (exact). About three instructions per weight: LOP3, FADD, FFMA."""
    part = tl.zeros(words.shape, tl.float32)
    for h in tl.static_range(2):
        half = words
        if h == 1:
            half = (words >> 16) & 0xFFFF
        for j in tl.static_range(4):
            k = k0 + rkw * 8 + 4 * h + j
            xj = tl.load(x_ptr + k)
            if HAS_PQS:  # x * pre_quant_scale, rounded to x's dtype as the reference does
                p = tl.load(pqs_ptr + k).to(x_ptr.dtype.element_ty).to(tl.float32)
                xj = (xj.to(tl.float32) * p).to(x_ptr.dtype.element_ty)
            xj = xj.to(tl.float32) * (1.0 / (1 << (4 * j)))
            part += xj[:, None] * _nibble_minus_8(half, j, magic)
    return part


@triton.jit
def _w4a16_kernel(
    x_ptr,
    qw_ptr,
    s_ptr,
    pqs_ptr,
    b_ptr,
    out_ptr,
    T,
    N,
    K,
    sxm,
    som,
    magic,
    HAS_PQS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    USE_DOT: tl.constexpr,
    IEEE: tl.constexpr,
    SPLIT_K: tl.constexpr,
    GEMV: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    STAGES: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """out[m, n] = sum_k (x[m, k] * pqs[k]) * (u[k, n] - 8) * scales[k // GROUP, n] (+ b[n]).

    SPLIT_K > 1: out is an fp32 partial buffer [SPLIT_K, T, N]; bias and cast happen later.
    K is a multiple of GROUP and GROUP of BLOCK_K, so K chunks need no mask.
    """
    pdl_begin(PDL)
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    sp = tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    mm = rm < T
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    nm = rn < N
    rk = tl.arange(0, BLOCK_K)
    rkw = tl.arange(0, BLOCK_K // 8)
    shifts = tl.arange(0, 8) * 4
    chunks = K // BLOCK_K
    per_split = tl.cdiv(chunks, SPLIT_K)
    k_lo = sp * per_split * BLOCK_K
    k_hi = tl.minimum(chunks, (sp + 1) * per_split) * BLOCK_K
    x_rows = x_ptr + rm.to(tl.int64)[:, None] * sxm
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_rows = tl.zeros([BLOCK_K // 8, BLOCK_N], tl.float32)  # GEMV: summed after the loop
    for k0 in tl.range(k_lo, k_hi, BLOCK_K, num_stages=STAGES):
        # [BLOCK_K/8, BLOCK_N] packed words (row r: k0 + 8r + j in nibble j)
        kw = (k0 // 8 + rkw).to(tl.int64)
        words = tl.load(
            qw_ptr + kw[:, None] * N + rn[None, :],
            mask=nm[None, :],
            other=0,
            eviction_policy="evict_first",
        )
        sc = tl.load(s_ptr + (k0 // GROUP) * N + rn, mask=nm, other=0.0).to(tl.float32)
        if GEMV:
            # the chunk lies in one group: its scale multiplies the chunk's sums, not each weight
            part = _gemv_chunk(words, x_ptr, pqs_ptr, k0, rkw, magic, HAS_PQS)
            acc_rows += part * sc[None, :]
        else:
            codes = tl.reshape(words[:, None, :] >> shifts[None, :, None], [BLOCK_K, BLOCK_N])
            w = _nibble_minus_8(codes, 0, magic) * sc[None, :]
            xk = tl.load(x_rows + (k0 + rk)[None, :], mask=mm[:, None], other=0.0)
            if HAS_PQS:
                p = tl.load(pqs_ptr + k0 + rk).to(x_ptr.dtype.element_ty).to(tl.float32)
                xk = (xk.to(tl.float32) * p[None, :]).to(x_ptr.dtype.element_ty)
            if USE_DOT:
                if IEEE:
                    acc = tl.dot(xk, w, acc, input_precision="ieee")
                else:
                    acc = tl.dot(xk, w.to(xk.dtype), acc)
            else:
                acc += tl.sum(xk.to(tl.float32)[:, :, None] * w[None, :, :], axis=1)
    if GEMV:
        acc = tl.sum(acc_rows, axis=0)[None, :]
    if SPLIT_K > 1:
        part = out_ptr + (sp * T).to(tl.int64) * N
        tl.store(
            part + rm.to(tl.int64)[:, None] * N + rn[None, :], acc, mask=mm[:, None] & nm[None, :]
        )
    else:
        if HAS_BIAS:
            acc += tl.load(b_ptr + rn, mask=nm, other=0.0).to(tl.float32)[None, :]
        o_ptrs = out_ptr + rm.to(tl.int64)[:, None] * som + rn[None, :]
        tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mm[:, None] & nm[None, :])


@triton.jit
def _split_reduce_kernel(
    part_ptr, b_ptr, out_ptr, T, N, som, HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr,
    BLOCK: tl.constexpr, PDL: tl.constexpr = False,
):  # fmt: skip
    """out[m, :] = sum_s part[s, m, :] (+ b) in out's dtype."""
    pdl_begin(PDL)
    m = tl.program_id(0)
    rn = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    nm = rn < N
    acc = tl.zeros([BLOCK], tl.float32)
    for s in tl.static_range(SPLIT_K):
        acc += tl.load(part_ptr + (s * T + m).to(tl.int64) * N + rn, mask=nm, other=0.0)
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=nm, other=0.0).to(tl.float32)
    tl.store(out_ptr + m.to(tl.int64) * som + rn, acc.to(out_ptr.dtype.element_ty), mask=nm)


def _split_params(tactic: Tactic | None) -> tuple[dict, dict]:
    p = tactic.as_dict() if tactic is not None else {}
    dec = {k[4:]: v for k, v in p.items() if k.startswith("dec_")}
    mm = {k[3:]: v for k, v in p.items() if k.startswith("mm_")}
    return dec or DECODE_TACTICS[0].as_dict(), mm or GEMM_TACTICS[0].as_dict()


def kernel_ok(x, qweight, scales, pre_quant_scale, group_size, zeros, bias, block_k: int) -> bool:
    """Shapes and layouts the kernel takes (any device: the caller decides where it runs)."""
    K = x.shape[-1] if x.dim() == 2 else -1
    return (
        x.dim() == 2
        and x.dtype in (torch.bfloat16, torch.float16, torch.float32)
        and x.stride(1) == 1
        and zeros is None
        and K > 0
        and K % group_size == 0
        and group_size % block_k == 0
        and qweight.dtype == torch.int32
        and qweight.shape[0] * 8 == K
        and qweight.is_contiguous()
        and scales.is_contiguous()
        and tuple(scales.shape) == (K // group_size, qweight.shape[1])
        and (pre_quant_scale is None or pre_quant_scale.is_contiguous())
        and (bias is None or bias.is_contiguous())
    )


def launch_w4a16(x, qweight, scales, pre_quant_scale, group_size, bias, out, params, decode):
    """Run the kernel (decode or gemm path with `params`) into out [T, N]; checked by kernel_ok."""
    T, K = x.shape
    N = qweight.shape[1]
    if T == 0 or N == 0:
        return out
    bn, bk = int(params["block_n"]), int(params["block_k"])
    if decode:
        bm, split = max(1, triton.next_power_of_2(T)), int(params.get("split_k", 1))
        split = max(1, min(split, K // bk))
    else:
        bm, split = int(params["block_m"]), 1
    dst = out
    if split > 1:
        dst = torch.empty((split, T, N), dtype=torch.float32, device=x.device)
    pqs = pre_quant_scale
    _w4a16_kernel[(triton.cdiv(T, bm), triton.cdiv(N, bn), split)](
        x,
        qweight,
        scales,
        pqs if pqs is not None else scales,
        bias if bias is not None else scales,
        dst,
        T,
        N,
        K,
        x.stride(0),
        out.stride(0),
        _MAGIC,
        HAS_PQS=pqs is not None,
        HAS_BIAS=bias is not None,
        USE_DOT=not decode,
        IEEE=x.dtype == torch.float32,
        SPLIT_K=split,
        GEMV=decode and bm == 1,
        GROUP=group_size,
        BLOCK_M=bm,
        BLOCK_N=bn,
        BLOCK_K=bk,
        STAGES=int(params.get("num_stages", 2)),
        num_warps=int(params.get("num_warps", 4)),
        num_stages=1,
        **launch_options(),
    )
    if split > 1:
        block = min(1024, triton.next_power_of_2(N))
        _split_reduce_kernel[(T, triton.cdiv(N, block))](
            dst,
            bias if bias is not None else dst,
            out,
            T,
            N,
            out.stride(0),
            HAS_BIAS=bias is not None,
            SPLIT_K=split,
            BLOCK=block,
            num_warps=4,
            **launch_options(),
        )
    return out


def make_w4a16_linear(tactic: Tactic | None = None):
    dec, mm = _split_params(tactic)
    max_m = int(dec.get("max_m", 1))

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
    ) -> torch.Tensor:
        """x: [T, K] -> [T, N] in x.dtype (written into `out` if given)."""
        decode = x.dim() == 2 and x.shape[0] <= max_m
        params = dec if decode else mm
        if x.device.type not in ("cuda", "meta") or not kernel_ok(
            x, qweight, scales, pre_quant_scale, group_size, zeros, bias, int(params["block_k"])
        ):  # meta: the AOT dry run records the launches
            y = _reference(x, qweight, scales, pre_quant_scale, group_size, zeros, bias)
            return y if out is None else out.copy_(y)
        if out is None:
            out = torch.empty((x.shape[0], qweight.shape[1]), dtype=x.dtype, device=x.device)
        return launch_w4a16(x, qweight, scales, pre_quant_scale, group_size, bias, out, params,
                            decode)  # fmt: skip

    return w4a16_linear
