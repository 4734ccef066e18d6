"""The W4A16 GEMM plugin's tactics (plugins/quant/triton_w4a16.py runs them): decode GEMVs, the
GEMMs for more rows, the small- and medium-batch halves, and how a plugin tactic joins them.
Plain data, so that listing or checking tactics needs no Triton."""

from __future__ import annotations

from ..registry import Tactic, joined_tactic


def _dec(
    bn: int, bg: int, w: int, s: int, max_m: int, packed: bool = False, persist: int = 0
) -> Tactic:
    params = (("block_n", bn), ("block_g", bg), ("num_warps", w), ("num_stages", s),
              ("max_m", max_m))  # fmt: skip
    name = f"dec_n{bn}_g{bg}_w{w}_s{s}_m{max_m}"
    if packed:  # bf16x2 arithmetic (`_packed_quad`); bf16 activations only
        name, params = name + "_p", params + (("packed", 1),)
    if persist:  # `persist` resident programs per SM, prefetching (w4a16_persistent.py)
        name, params = name + f"_r{persist}", params + (("persist", persist),)
    return Tactic(name, params)


def _dec_mma(
    tiles: int, warps: int, unroll: int, prefetch: bool = False, xtiles: int = 1
) -> Tactic:
    """The tensor-core GEMV (bf16 x, up to 8 rows); what it does not take (other dtypes, more
    rows) runs the packed n16 GEMV of the same tactic, as the first tactic does. prefetch:
    each block's words loaded a pass ahead (one tile only). xtiles: 8 x rows each (2 or 4,
    one tile only), all taking one pass over the weights."""
    assert not prefetch or (tiles == 1 and unroll <= 2)
    assert xtiles == 1 or (tiles == 1 and not prefetch)
    plain = (("block_n", 16), ("block_g", 16), ("num_warps", 4), ("num_stages", 1), ("max_m", 1),
             ("packed", 1))  # fmt: skip
    mma = (("mma", 1), ("tiles", tiles), ("mma_warps", warps), ("unroll", unroll))
    name = f"dec_mma_t{tiles}_w{warps}_u{unroll}_m1"
    if prefetch:
        name, mma = name + "_pf", mma + (("prefetch", 1),)
    if xtiles > 1:
        name, mma = name + f"_x{xtiles}", mma + (("xtiles", xtiles),)
    return Tactic(name, plain + mma)


def _mm(bm: int, bn: int, bk: int, w: int, s: int) -> Tactic:
    return Tactic(
        f"mm_m{bm}_n{bn}_k{bk}_w{w}_s{s}",
        (("block_m", bm), ("block_n", bn), ("block_k", bk), ("num_warps", w), ("num_stages", s)),
    )


def _mm_split(bm: int, bn: int, bk: int, w: int, s: int, split: int) -> Tactic:
    """The Triton GEMM with K split over `split` programs a tile (fp32 partial sums, then a
    kernel adding them): for a few dozen rows, whose tiles alone leave most SMs idle."""
    t = _mm(bm, bn, bk, w, s)
    return Tactic(f"{t.name}_sk{split}", t.params + (("split_k", split),))


# NOTE: a build on the GPU times these per use site (compiler/tactic_select.py); the first of
# each is the default when cross-building without a GPU. GEMV: block_g blocks of 128 k per
# chunk (32 blocks x 16 words is one 4-warp pass over a K = 4,096 row); BLOCK_M * BLOCK_N * 4
# fp32 accumulators per thread. First (the cross-build default): packed n16_g16_w4, the
# fastest summed over the four sites on the H200 (64.4 us a layer against 69.1 for fp32
# n8_g16_w2, the fastest fp32 one; it is fastest or within 0.1 us at qkv, o and down, and
# 1.3 us behind packed n8_g16_w2 at gate_up; docs/bench/bench-w4a16-2026-12-05-packed.json).
# Packed tactics take bf16 x; other dtypes run the fp32 loop with the same blocks.
DECODE_TACTICS: tuple[Tactic, ...] = (
    _dec(16, 16, 4, 1, 1, packed=True),
    _dec(8, 16, 2, 1, 1),
    _dec(4, 32, 4, 1, 1),
    _dec(8, 32, 4, 1, 1),
    _dec(2, 32, 4, 1, 2),
    _dec(4, 16, 2, 1, 1),
    _dec(4, 64, 8, 1, 1),
    _dec(8, 32, 4, 2, 1),
    _dec(1, 32, 4, 1, 4),
    # packed (bf16x2): 2.9-3.0 sm_90 instructions a weight in the K loop against 4.4
    _dec(8, 16, 2, 1, 1, packed=True),
    _dec(8, 32, 4, 1, 1, packed=True),
    _dec(4, 32, 4, 1, 2, packed=True),
    # resident programs walking several tiles, each loading its next chunk while it computes
    # one (w4a16_persistent.py): a thread holds two chunks, so narrow ones, and as many
    # programs per SM as their registers let stay resident (sm_90: 96-128 registers a thread
    # for the n4 / n8_g16 ones, 128-168 for n8_g8, with PDL and SwiGLU variants)
    _dec(8, 16, 2, 1, 1, packed=True, persist=8),
    _dec(8, 32, 4, 1, 1, packed=True, persist=4),
    _dec(4, 32, 4, 1, 1, packed=True, persist=5),
    _dec(8, 8, 2, 1, 1, packed=True, persist=6),
    # on the tensor cores (w4a16_mma.py): 16 TILES rows a program, WARPS splitting K, UNROLL
    # blocks a warp in flight; one tile keeps N = 4,096 at 256 programs, two or four (for
    # gate_up's 28,672 rows) share x's work
    *(
        _dec_mma(tiles, warps, unroll)
        for tiles, warps, unroll in (
            (1, 4, 2),
            (1, 8, 2),
            (2, 4, 1),
            (2, 8, 1),
            (2, 4, 2),
            (4, 4, 1),
        )
    ),
    # the H100 timed the ones above slower than the CUDA-core GEMVs at every site though they
    # issue fewer instructions: these keep the next pass's weights in flight (PREFETCH)
    _dec_mma(1, 4, 2, prefetch=True),
    _dec_mma(1, 8, 2, prefetch=True),
)
# the dequantize-then-cuBLAS GEMM: the weight expanded to the model dtype by a Triton kernel
# (BLOCK_N rows of one 128-k block a program), then one cuBLAS GEMM (`_dequant_matmul`). From
# min_rows rows of x only: the expansion moves 4.5 bytes a weight (read 0.5, write 2, the GEMM
# reads 2) against the Triton GEMM's 0.5, which a small batch's GEMM does not pay back; fewer
# rows (decode batches past the GEMV's max_m) run the first Triton GEMM tactic
DEQUANT_GEMM = Tactic(
    "mm_dequant_n32",
    (("dequant", 1), ("min_rows", 128), ("block_n", 32), ("block_k", 128), ("num_warps", 4)),
)


def _dequant_chunked(mib: int) -> Tactic:
    """DEQUANT_GEMM a slab of rows at a time: each slab's expansion (`chunk_bytes` of the
    model dtype, one reused buffer) is read back by its GEMM while it is still in the 50 MB
    L2, so the 4 bytes a weight the expansion writes and reads mostly stay on chip; more,
    smaller launches. Timed by the build beside the others."""
    return Tactic(
        f"{DEQUANT_GEMM.name}_c{mib}m", DEQUANT_GEMM.params + (("chunk_bytes", mib << 20),)
    )


# NOTE: the whole expansion cost ~75 us of gate_up's 766 at 2,048 rows and about half of its
# 218 at 128 on the H100 (docs/bench/bench-w4a16-prefill-h100-2026-12-05.json)
DEQUANT_CHUNKED = (_dequant_chunked(8), _dequant_chunked(16))
# NOTE: on the H200 the Triton GEMMs ran 81-267 us a site at 128 rows and 418-2,793 at 2,048
# (docs/bench/bench-w4a16-prefill-2026-12-05.json), where cuBLAS at those shapes in BF16 takes
# a fraction and the expansion reads 0.5 and writes 2 bytes a weight; the build times them all
GEMM_TACTICS: tuple[Tactic, ...] = (  # block_k: a multiple of 128 (whole interleaved blocks)
    _mm(64, 128, 128, 4, 3),
    _mm(128, 128, 128, 8, 3),
    _mm(32, 64, 128, 4, 3),
    _mm(128, 256, 128, 8, 3),
    _mm(16, 64, 128, 4, 4),
    DEQUANT_GEMM,
    *DEQUANT_CHUNKED,
)


def swiglu_apart(dec: Tactic) -> Tactic:
    """The decode GEMV `dec` given SwiGLU's output by the SwiGLU kernel rather than applying
    it as x is loaded (the down projection's candidates): a gated GEMV recomputes silu(gate) *
    up over all of K in every program, which made the FP8 down GEMV 33% slower than the two
    kernels (H100, docs/performance.md 2026-12-05 evening). The same bits either way."""
    return Tactic(dec.name + "_sa", dec.params + (("swiglu_apart", 1),))


def decode_candidates(gated: bool) -> list[Tactic]:
    """The decode GEMV candidates of a site: every decode tactic, and where x is [gate | up]
    (the down projection) each non-tensor-core one's `swiglu_apart` twin too (the tensor-core
    ones run the SwiGLU kernel first anyway)."""
    twins = [swiglu_apart(d) for d in DECODE_TACTICS if not d.as_dict().get("mma")] if gated else []
    return list(DECODE_TACTICS) + twins


def combine_tactics(
    dec: Tactic, mm: Tactic, small: Tactic | None = None, mid: Tactic | None = None
) -> Tactic:
    """A w4a16_gemm tactic: the GEMV `dec` for decode rows (up to its max_m), the GEMM `mm` for
    more; small: an `mma` tactic (SMALL_TACTICS) that takes the rows past max_m up to
    MMA_ROWS (decode batches of 2-8, short prompts) instead of the GEMM; mid: a split-K GEMM
    (MID_TACTICS) for the rows past those up to MID_ROWS (decode batches of 9-64)."""
    return joined_tactic(("dec_", dec, ""), ("mm_", mm, ""), ("sb_", small, "small_"),
                         ("md_", mid, "mid_"))  # fmt: skip


# the small-batch half's candidates: the tensor-core GEMV takes up to 8 rows of x at about the
# cost of one, where the GEMM reads and expands the whole weight for them (the build times
# them against the GEMM at the largest of those decode buckets)
SMALL_TACTICS: tuple[Tactic, ...] = tuple(t for t in DECODE_TACTICS if t.as_dict().get("mma"))

# the medium-batch half's candidates: split-K GEMMs. Past 8 rows a decode batch ran the GEMM
# half's first Triton tactic (the dequantize-then-cuBLAS one needs 128 rows), whose tiles leave
# most SMs idle at a few dozen rows: 631 us a layer at 8 rows on the H200 against 86 for the
# small-batch half (docs/bench/quant-int4-2026-12-05-late.json). Split over K, a tile's weights
# are read by several programs side by side; their fp32 partial sums are added by a second
# kernel in a fixed order (the same bits every run). block_m is the most rows a tile takes: a
# batch of T rows runs tiles of next_power_of_2(T) rows (at least 16), which on the H100 was
# fastest at 16, 32 and 64 rows with every other parameter the same; there n128_w4_sk8 took a
# layer's qkv, o and down in 25.0 / 16.7 / 49.7 us at 16 rows and 36.8 / 24.1 / 66.9 at 64
# against the GEMM's 80 / 81 / 285, gate_up 90.9 and 144 against 110 (sk4: 88.2 and 124;
# docs/bench/w4a16-mid-batch-h100-2026-12-05-late.json). The build times them at MID_TIMED_ROWS
# rows and keeps the least total, or none.
MID_ROWS = 64
MID_TIMED_ROWS = (16, 64)
MID_TACTICS: tuple[Tactic, ...] = (
    _mm_split(64, 128, 128, 4, 3, 8),
    # the tensor-core GEMV with 16 or 32 x rows a launch (each weight fragment used 2 or 4
    # times), more rows in passes of that many (the weight read again, mostly from L2). sm_90
    # (scripts/sass_w4a16.py): 3.7-3.9 instructions a weight for 16 rows (150 registers),
    # 6.3-7.0 for 32 (168-244), against 2.5-2.6 for 8: not timed yet
    _dec_mma(1, 4, 2, xtiles=2),
    _dec_mma(1, 8, 2, xtiles=2),
    _dec_mma(1, 4, 2, xtiles=4),
    _dec_mma(1, 4, 1, xtiles=4),
    _mm_split(64, 128, 128, 4, 3, 4),
    _mm_split(64, 128, 128, 4, 3, 2),
    _mm_split(64, 64, 128, 4, 3, 4),
    _mm_split(64, 256, 128, 8, 3, 4),
    _mm_split(64, 128, 128, 8, 3, 4),
)


# NOTE: the first is the default of builds without a GPU (cross-builds): the first pair with
# the first small-batch and medium-batch halves, each 3-6x (small, 8 rows, H100 and H200) and
# 2-3x (split-K, 16 rows, H100) faster than the GEMM those batches ran before at qkv, o and
# down, and at gate_up ahead at 8 and 16 rows, 14-30% behind at 32-64
W4A16_TACTICS: tuple[Tactic, ...] = tuple(
    [combine_tactics(DECODE_TACTICS[0], GEMM_TACTICS[0], SMALL_TACTICS[0], MID_TACTICS[0])]
    + [combine_tactics(DECODE_TACTICS[0], m) for m in GEMM_TACTICS]
    + [combine_tactics(d, GEMM_TACTICS[0]) for d in DECODE_TACTICS[1:]]
)
