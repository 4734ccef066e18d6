"""Paged attention for decode (one query per sequence) in Triton, and the `paged_attention`
entry point that dispatches between it and the prefill kernel.

Decode is flash-decoding with GQA packing. Grid (sequence, kv head, split): one program takes
one kv head's group of G query heads (a [G, hd] tile, padded to 16 rows for the tensor cores)
so K/V are read once per group, over one partition of the context. With more than one split,
each program writes its unnormalised accumulator and (max, sum) in base 2 and counts itself
done on a per-(sequence, kv head) counter; the program that finds itself last merges the
group's partials and writes the output (no second kernel: at batch 1 a separate merge kernel
cost 2.5 us per layer plus its launch gap on the H200). The counter goes back to zero in the
same program, so every launch (and CUDA-graph replay) finds it zeroed.

With `new_v` the program whose split holds a sequence's newest key takes that key's tile first,
puts the token's V into it in registers and stores the tile back whole when it is one 32-token
segment of a transposed V (an FP8 pool's: the token alone is one byte in each of hd 32-byte
rows, partial-sector writes that made the RoPE kernel's KV write at batch 512 three times
slower on the H200). Its partials then differ from the plain kernel's in summation order only.
A first version stored the token before the loop and read it back after a CTA barrier: +19 us
per layer at 512 x 192 keys on the H200, more than the RoPE kernel saved, so engines leave
new_v off (runtime/model.py: decode_writes_v). This version loses too (H200, 12-03 21:20:
+21 us per layer at 512 x 192 keys, +31 at 128 x 3,072, against the 15.5 the RoPE kernel
saves); on sm_90 it takes 186 registers per thread with one warp against 164 (10 programs per
SM instead of 12); putting the token into the loop's last tile instead took 255 and spilled.

The number of splits is fixed by an upper bound on the context (the block table's width by
default: no host sync, the same launch for every step of a CUDA graph), but each sequence
divides its own context (the part inside the sliding window) evenly over them, in multiples
of BLOCK_N. So a short context in a graph captured for max_seq_len still spreads over every
split instead of leaving most programs idle and a few walking long partitions (H200, batch 1,
128-token context: 8.2 us per layer with fixed 128-key partitions).
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

from ..pdl import launch_options, pdl_begin
from ..quant.row_room import empty_rows
from ..quant.triton_quantize import quant_fp8
from ..registry import Tactic, joined_tactic
from .layout import SHORT_CONTEXT, check_kv_layout, is_transposed
from .reference import ANY_DECODES, check_new_v, decode_rows
from .triton_decode_fp8mma import decode_fp8mma
from .triton_prefill import (
    LOG2E,
    PREFILL_TACTICS,
    SHORT_PROMPT,
    SHORT_PROMPT_TACTICS,
    fp16_query,
    kv_tile,
    launch_prefill,
    load_v,
    out_values,
    read_ahead,
    tile_blocks,
)

# for large batches, the context split until 8,192 programs run but no sequence's split
# shorter than 512 (256) keys: a step whose batch fills its graph's bucket only in part
# (435 sequences padded to 512 at 2,048 / 2,048) otherwise got one split, 2.2 waves of
# 3,072-key programs on the H200's SMs (the engine's decode attention ~20% slower than at
# 448 sequences in two splits).
_T8192_M512 = Tactic(
    "p512_n32_w1_s3_t8192_m512",
    (
        ("partition", 512),
        ("block_n", 32),
        ("num_warps", 1),
        ("num_stages", 3),
        ("programs", 8192),
        ("split_min", 512),
    ),
)  # fmt: skip
_W2_T2048 = Tactic(
    "p128_n32_w2_s3_t2048",
    (
        ("partition", 128),
        ("block_n", 32),
        ("num_warps", 2),
        ("num_stages", 3),
        ("programs", 2048),
    ),
)  # fmt: skip


DECODE_TACTICS: tuple[Tactic, ...] = (
    Tactic(
        "p128_n32_w4_s3", (("partition", 128), ("block_n", 32), ("num_warps", 4), ("num_stages", 3))
    ),
    Tactic(
        "p256_n32_w4_s3", (("partition", 256), ("block_n", 32), ("num_warps", 4), ("num_stages", 3))
    ),
    Tactic(
        "p128_n32_w4_s2", (("partition", 128), ("block_n", 32), ("num_warps", 4), ("num_stages", 2))
    ),
    Tactic(
        "p64_n32_w4_s2", (("partition", 64), ("block_n", 32), ("num_warps", 4), ("num_stages", 2))
    ),
    Tactic(
        "p256_n64_w8_s3", (("partition", 256), ("block_n", 64), ("num_warps", 8), ("num_stages", 3))
    ),
    Tactic(
        "p128_n64_w8_s2", (("partition", 128), ("block_n", 64), ("num_warps", 8), ("num_stages", 2))
    ),
    Tactic(
        "p512_n64_w8_s3", (("partition", 512), ("block_n", 64), ("num_warps", 8), ("num_stages", 3))
    ),
    Tactic(
        "p512_n32_w4_s4", (("partition", 512), ("block_n", 32), ("num_warps", 4), ("num_stages", 4))
    ),
    # small batches, fewer and longer splits: no split shorter than 64 (128) keys, so a short
    # context runs a few programs of several tiles each and merges fewer partials
    Tactic(
        "p128_n32_w4_s3_m64",
        (
            ("partition", 128),
            ("block_n", 32),
            ("num_warps", 4),
            ("num_stages", 3),
            ("split_min", 64),
        ),
    ),  # fmt: skip
    Tactic(
        "p128_n32_w4_s3_m128",
        (
            ("partition", 128),
            ("block_n", 32),
            ("num_warps", 4),
            ("num_stages", 3),
            ("split_min", 128),
        ),
    ),  # fmt: skip
    Tactic(
        "p128_n64_w4_s3_m128",
        (
            ("partition", 128),
            ("block_n", 64),
            ("num_warps", 4),
            ("num_stages", 3),
            ("split_min", 128),
        ),
    ),  # fmt: skip
    _T8192_M512,
    Tactic(
        "p256_n32_w1_s3_t8192_m256",
        (
            ("partition", 256),
            ("block_n", 32),
            ("num_warps", 1),
            ("num_stages", 3),
            ("programs", 8192),
            ("split_min", 256),
        ),
    ),  # fmt: skip
    # the large-batch tactics with each tile's block-table entry read a tile ahead (BT_AHEAD):
    # two tiles of K/V in flight a program instead of one (20 KB of shared memory against 12,
    # so 10 one-warp programs an SM instead of 12). Why: at 512 x 192 keys the one-warp FP8
    # kernel waits on global memory for 65% of its stalls at ~11 warps an SM (Nsight Compute,
    # H100, docs/performance.md 12-06 14:20). Timed on the H100 (12-06 17:00): within 3% of
    # their plain twins either way at the large-batch points (the pipeliner's one buffer was
    # not what bounds them); a build picked t2048_a once. Three tiles (num_stages 4) lost at
    # every point and went out.
    read_ahead(_T8192_M512),
    read_ahead(_W2_T2048),
    # for large batches: one-warp (two-warp) programs, the context split until 4,096 (2,048)
    # programs run. With an FP8 cache at batch 128 x 3,072 keys on the H200: 246 us (77% of
    # the bandwidth) against 352 us for the best four-warp tactic.
    Tactic(
        "p128_n32_w1_s3_t4096",
        (
            ("partition", 128),
            ("block_n", 32),
            ("num_warps", 1),
            ("num_stages", 3),
            ("programs", 4096),
        ),
    ),  # fmt: skip
    _W2_T2048,
)
# the tactics meant for large batches (a target program count): the GPU tests run each as one
LARGE_BATCH_TACTICS = tuple(t for t in DECODE_TACTICS if "programs" in t.as_dict())
# Decode steps with at least this many sequences x kv heads run the engine's large-batch
# decode tactic (timed at a large batch), smaller ones its small-batch one: the best
# configuration differs (e.g. 32 sequences of a model with 8 kv heads).
LARGE_BATCH_ROWS = 256

# the split programs' done-counters, [rows] int32 per device: zeroed once, left zeroed by
# every launch; never freed (captured graphs hold their address), only outgrown.
# NOTE: one decode launch at a time per device (the executor's one stream): two running at once
# on two streams would count on the same counters.
_COUNTERS: dict[torch.device, torch.Tensor] = {}
_OUTGROWN: list[torch.Tensor] = []
_MIN_COUNTERS = 1 << 16


def _counters(rows: int, device: torch.device) -> torch.Tensor:
    buf = _COUNTERS.get(device)
    if buf is None or buf.numel() < rows:
        # NOTE: a larger buffer replaces the cached one; an outgrown one stays alive (graphs
        # captured with it keep working) by staying referenced here
        if buf is not None:
            _OUTGROWN.append(buf)
        buf = _COUNTERS[device] = torch.zeros(max(rows, _MIN_COUNTERS), dtype=torch.int32,
                                              device=device)  # fmt: skip
    return buf


# Programs (sequence x kv head x split) that keep the GPU busy. Splitting a context only pays
# while sequences x kv heads alone are fewer; a constant (not the SM count) so the AOT dry run
# on `meta` picks the same split plan as the GPU.
_TARGET_PROGRAMS = 1024


def split_plan(
    rows: int, max_context_len: int, min_partition: int, target: int | None = None
) -> int:
    """Splits of the context for `rows` = sequences x kv heads: as many as `max_context_len`
    needs at `min_partition` keys each, but no more than it takes to reach `target` programs
    (_TARGET_PROGRAMS by default; a tactic may set its own). Large batches get one split: no
    partials, no merge. (Each sequence then spreads its own context over them:
    `_split_range`.)"""
    target = _TARGET_PROGRAMS if target is None else target
    by_context = max(1, triton.cdiv(max_context_len, min_partition))
    return max(1, min(by_context, triton.cdiv(target, max(rows, 1))))


@triton.jit
def _split_range(
    ctx,
    window,
    NUM_SPLITS,
    USE_WINDOW: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT_MIN: tl.constexpr,
):
    """(first key, keys per split) of a sequence's context: the keys its query sees (those
    > ctx - 1 - window with a window), from a BLOCK_N boundary, over NUM_SPLITS splits, none
    shorter than SPLIT_MIN keys (a multiple of BLOCK_N): a short context then takes fewer
    splits (the others find no keys) and skips the merge."""
    first = ctx * 0
    if USE_WINDOW:
        first = (tl.maximum(ctx - window, 0) // BLOCK_N) * BLOCK_N
    part = tl.cdiv(tl.cdiv(ctx - first, NUM_SPLITS), BLOCK_N) * BLOCK_N
    if SPLIT_MIN > BLOCK_N:
        part = tl.maximum(part, SPLIT_MIN)
    return first, tl.maximum(part, BLOCK_N)


def split_min_keys(params: dict, block_n: int) -> int:
    """A tactic's least keys per split (its `split_min`, rounded up to a multiple of block_n;
    0: none): the kernel's SPLIT_MIN, and what bounds the splits a context needs."""
    return -(-int(params.get("split_min", 0)) // block_n) * block_n


# NOTE: seq0 (first sequence of the launch) and NUM_SPLITS are never specialized: one binary
# for any value, so the decode part of a mixed step (any number of sequences) launches the
# binaries the decode graphs' dry run compiled ahead of time.
@triton.jit(do_not_specialize=["seq0", "NUM_SPLITS"])
def _decode_kernel(
    q_ptr,
    kc_ptr,
    vc_ptr,
    ks_ptr,
    vs_ptr,
    bt_ptr,
    ctx_ptr,
    out_ptr,
    po_ptr,
    pml_ptr,
    cnt_ptr,
    os_ptr,
    nv_ptr,
    qsl_ptr,
    scale_log2,
    window,
    G,
    HD: tl.constexpr,
    BS: tl.constexpr,
    NUM_SPLITS,
    seq0,
    sqt,
    sqh,
    sot,
    soh,
    s_blk,
    s_tok,
    s_h,
    s_bt,
    snt,
    snh,
    V_T: tl.constexpr,
    SPLIT: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    IEEE: tl.constexpr,
    KV_FP8: tl.constexpr,
    BLOCK_N: tl.constexpr,
    G_PAD: tl.constexpr,
    D_PAD: tl.constexpr,
    G_POW2: tl.constexpr,
    MERGE_SPLITS: tl.constexpr,
    PDL: tl.constexpr = False,
    QUANT_OUT: tl.constexpr = False,
    WRITE_V: tl.constexpr = False,
    SEG: tl.constexpr = 32,
    SPLIT_MIN: tl.constexpr = 0,
    QSL_ROWS: tl.constexpr = False,
    BT_AHEAD: tl.constexpr = False,
):
    """QSL_ROWS: program b is sequence b of a step with prompts (seq0 0) and attends only if
    that sequence has one query, at row qsl[b] of q and out (ANY_DECODES, reference.py);
    otherwise row b of q and out is sequence seq0 + b, one query each. BT_AHEAD (tiles inside
    one block): each tile's block-table entry read one tile ahead, so that Triton's pipeliner
    keeps num_stages - 1 tiles of K/V in flight (with the entry read in the same iteration it
    kept one buffer: the copy of the next tile waited for the current tile's math)."""
    pdl_begin(PDL)
    b = tl.program_id(0)  # row of q and out; sequence seq0 + b of the batch
    kvh = tl.program_id(1)
    sp = tl.program_id(2)
    ctx = tl.load(ctx_ptr + seq0 + b)
    first, part = _split_range(ctx, window, NUM_SPLITS, USE_WINDOW, BLOCK_N, SPLIT_MIN)
    lo = first + sp * part
    end = tl.minimum(lo + part, ctx)
    if QSL_ROWS:
        q0 = tl.load(qsl_ptr + b)
        end = tl.where(tl.load(qsl_ptr + b + 1) - q0 == 1, end, lo)  # else: no keys here
        # row q0 of q and out is where the code below reads and writes row b
        q_ptr += (q0 - b).to(tl.int64) * sqt
        out_ptr += (q0 - b).to(tl.int64) * sot
    if lo < end:
        g = tl.arange(0, G_PAD)
        d = tl.arange(0, D_PAD)
        gm = g < G
        dm = d < HD
        heads = kvh * G + g
        q = tl.load(
            q_ptr + b.to(tl.int64) * sqt + heads[:, None] * sqh + d[None, :],
            mask=gm[:, None] & dm[None, :],
            other=0.0,
        )
        m_i = tl.full([G_PAD], -1.0e30, tl.float32)
        l_i = tl.zeros([G_PAD], tl.float32)
        acc = tl.zeros([G_PAD, D_PAD], tl.float32)
        bt_row = bt_ptr + (seq0 + b).to(tl.int64) * s_bt
        if KV_FP8:  # q . (k * ks) == (q . k) * ks: the K scale joins the softmax scale
            scale_log2 = scale_log2 * tl.load(ks_ptr)
            if not IEEE:  # the dots run in fp16 (fp16_query)
                q, scale_log2 = fp16_query(q, scale_log2)
        hi = end
        if WRITE_V:
            if end == ctx:
                # this split holds the newest key: its tile first, the new V put in and stored
                last = lo + (end - 1 - lo) // BLOCK_N * BLOCK_N
                nv = _new_v(nv_ptr + b.to(tl.int64) * snt + kvh * snh, vs_ptr, vc_ptr, d, dm,
                            KV_FP8)  # fmt: skip
                m_i, l_i, acc = _decode_tile(
                    q, m_i, l_i, acc, last, end, ctx, window, scale_log2, kc_ptr, vc_ptr, nv,
                    bt_row, kvh, d, dm, s_blk, s_tok, s_h, HD, BS, V_T, USE_WINDOW, IEEE,
                    BLOCK_N, SEG, True,
                )  # fmt: skip
                hi = last
        # BT_AHEAD: each tile's block read one tile ahead, so that its K/V addresses come from
        # the loop's carried value, not from a load in the same iteration
        blk = tile_blocks(bt_row, lo, hi, BS, BLOCK_N) if BT_AHEAD else None
        for n0 in range(lo, hi, BLOCK_N):
            if BT_AHEAD:
                nxt = tile_blocks(bt_row, n0 + BLOCK_N, hi, BS, BLOCK_N)
            m_i, l_i, acc = _decode_tile(
                q, m_i, l_i, acc, n0, end, ctx, window, scale_log2, kc_ptr, vc_ptr, None,
                bt_row, kvh, d, dm, s_blk, s_tok, s_h, HD, BS, V_T, USE_WINDOW, IEEE,
                BLOCK_N, SEG, False, blk,
            )  # fmt: skip
            if BT_AHEAD:
                blk = nxt
        if KV_FP8:  # sum p (v * vs) == vs * sum p v (partials too: the merge is linear in them)
            acc = acc * tl.load(vs_ptr)
        if SPLIT:
            n_used = tl.cdiv(ctx - first, part)  # splits holding keys of this sequence
            if n_used > 1:  # each writes partials; the last one done merges them
                # partials: po [B, Hq, NUM_SPLITS, D_PAD] fp32, pml [B, Hq, NUM_SPLITS, 2] fp32
                row = (b * (G * tl.num_programs(1)) + heads).to(tl.int64) * NUM_SPLITS + sp
                tl.store(po_ptr + row[:, None] * D_PAD + d[None, :], acc, mask=gm[:, None])
                tl.store(pml_ptr + row * 2, m_i, mask=gm)
                tl.store(pml_ptr + row * 2 + 1, l_i, mask=gm)
                # NOTE: every thread's stores, then one acq_rel atomic at GPU scope (the
                # barrier orders them before it, the release makes them visible with it): the
                # program that counts last sees every other split's partials.
                tl.debug_barrier()
                cnt = cnt_ptr + b * tl.num_programs(1) + kvh
                if tl.atomic_add(cnt, 1, sem="acq_rel", scope="gpu") == n_used - 1:
                    tl.debug_barrier()
                    _merge_splits(
                        po_ptr, pml_ptr, q_ptr, out_ptr, os_ptr, b, kvh, G, n_used, NUM_SPLITS,
                        sot, soh, HD, G_POW2, MERGE_SPLITS, D_PAD, QUANT_OUT,
                    )  # fmt: skip
                    tl.atomic_xchg(cnt, 0, sem="relaxed", scope="gpu")  # zeroed for next time
            else:  # the only split with keys
                _write_out(q_ptr, out_ptr, os_ptr, acc, l_i, b, heads, d, gm, dm, sot, soh,
                           QUANT_OUT)  # fmt: skip
        else:
            _write_out(q_ptr, out_ptr, os_ptr, acc, l_i, b, heads, d, gm, dm, sot, soh, QUANT_OUT)


@triton.jit
def _decode_tile(
    q, m_i, l_i, acc, n0, end, ctx, window, scale_log2, kc_ptr, vc_ptr, nv, bt_row, kvh, d, dm,
    s_blk, s_tok, s_h,
    HD: tl.constexpr, BS: tl.constexpr, V_T: tl.constexpr, USE_WINDOW: tl.constexpr,
    IEEE: tl.constexpr, BLOCK_N: tl.constexpr, SEG: tl.constexpr, PUT_V: tl.constexpr,
    blk=None,
):  # fmt: skip
    """Keys n0 .. n0 + BLOCK_N - 1 (those < end) into the online softmax (m_i, l_i, acc).
    PUT_V: the tile holds the newest key (ctx - 1), whose V `nv` is not in the cache yet."""
    t = n0 + tl.arange(0, BLOCK_N)
    tv = t < end
    if USE_WINDOW:
        tv = tv & (t > ctx - 1 - window)
    # blk: the tile's block, read ahead (BT_AHEAD: BS a multiple of BLOCK_N)
    base, rows = kv_tile(bt_row, n0, t < end, kvh, s_blk, s_tok, s_h, BS, BLOCK_N, blk)
    off = rows[:, None] + d[None, :]
    kv_mask = tv[:, None] & dm[None, :]
    # an FP8 cache's K/V convert exactly to q's dtype (fp16 unless IEEE); the scales are
    # applied outside the loop
    k = tl.load(kc_ptr + base + off, mask=kv_mask, other=0.0)
    v = load_v(
        vc_ptr, base, off, kv_mask, bt_row, n0, end, tv, kvh, d, dm, s_blk, HD, BS, V_T, BLOCK_N,
        blk,
    )  # fmt: skip
    if PUT_V:
        v = _put_new_v(vc_ptr, v, nv, bt_row, ctx - 1, n0, kvh, d, dm, s_blk, s_tok, s_h,
                       HD, BS, V_T, BLOCK_N, SEG)  # fmt: skip
    # NOTE: float32 engines must not round to TF32 (they are checked token for token).
    if IEEE:
        s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision="ieee") * scale_log2
    else:
        s = tl.dot(q, tl.trans(k.to(q.dtype))) * scale_log2
    s = tl.where(tv[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if IEEE:
        pv = tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision="ieee")
    else:
        pv = tl.dot(p.to(q.dtype), v.to(q.dtype))
    return m_new, l_i, acc * alpha[:, None] + pv


@triton.jit
def _new_v(nv_row, vs_ptr, vc_ptr, d, dm, KV_FP8: tl.constexpr):
    """A decode row's new V ([D_PAD] at nv_row, the model dtype) in the cache's dtype: FP8
    quantized as the KV write does."""
    v = tl.load(nv_row + d, mask=dm, other=0.0)
    if KV_FP8:
        v = quant_fp8(v.to(tl.float32), tl.load(vs_ptr))
    return v.to(vc_ptr.dtype.element_ty)


@triton.jit
def _put_new_v(
    vc_ptr, v, nv, bt_row, pos, n0, kvh, d, dm, s_blk, s_tok, s_h,
    HD: tl.constexpr, BS: tl.constexpr, V_T: tl.constexpr, BLOCK_N: tl.constexpr,
    SEG: tl.constexpr,
):  # fmt: skip
    """The V tile `v` [BLOCK_N, D_PAD] of keys n0.. with the newest key's (`pos`) column
    replaced by `nv`, which is also stored into the cache. When the tile is one SEG-token
    segment of a transposed (FP8) V, read whole by load_v, it is stored back whole: HD full
    32-byte sectors, the other tokens' bytes unchanged."""
    t = n0 + tl.arange(0, BLOCK_N)
    v = tl.where((t == pos)[:, None], nv[None, :], v)
    blk = tl.load(bt_row + pos // BS).to(tl.int64)
    if V_T:
        if BLOCK_N == SEG and BS % BLOCK_N == 0:
            # NOTE: load_v's addresses and hints: 16-byte stores along the tokens
            r = tl.max_contiguous(tl.multiple_of(n0 % BS + tl.arange(0, BLOCK_N), BLOCK_N),
                                  BLOCK_N)  # fmt: skip
            ptr = vc_ptr + blk * s_blk + kvh * (HD * BS) + r[:, None] + d[None, :] * BS
            tl.store(ptr, v, mask=dm[None, :])
        else:  # the token's column alone
            tl.store(vc_ptr + blk * s_blk + kvh * (HD * BS) + pos % BS + d * BS, nv, mask=dm)
    else:  # V shares K's layout: one row
        tl.store(vc_ptr + blk * s_blk + (pos % BS) * s_tok + kvh * s_h + d, nv, mask=dm)
    return v


@triton.jit
def _write_out(
    q_ptr, out_ptr, os_ptr, acc, l_i, b, heads, d, gm, dm, sot, soh, QUANT_OUT: tl.constexpr
):
    """out rows of `heads` = acc / l_i (a split that saw every key of its sequence)."""
    l_i = tl.where(l_i > 0.0, l_i, 1.0)
    tl.store(
        out_ptr + b.to(tl.int64) * sot + heads[:, None] * soh + d[None, :],
        out_values(acc / l_i[:, None], q_ptr, out_ptr, os_ptr, QUANT_OUT),
        mask=gm[:, None] & dm[None, :],
    )


@triton.jit
def _merge_splits(
    po_ptr,
    pml_ptr,
    q_ptr,
    out_ptr,
    os_ptr,
    b,
    kvh,
    G,
    n_used,
    NUM_SPLITS,
    sot,
    soh,
    HD: tl.constexpr,
    G_POW2: tl.constexpr,
    MERGE_SPLITS: tl.constexpr,
    D_PAD: tl.constexpr,
    QUANT_OUT: tl.constexpr,
):
    """out[b, heads of kv head kvh] = the splits' partials merged (flash-decoding): MERGE_SPLITS
    splits of all G heads per step, [G_POW2, MERGE_SPLITS, D_PAD] fp32."""
    g = tl.arange(0, G_POW2)
    gm = g < G
    heads = kvh * G + g
    d = tl.arange(0, D_PAD)
    base = (b * (G * tl.num_programs(1)) + heads).to(tl.int64) * NUM_SPLITS  # [G_POW2]
    m_run = tl.full([G_POW2], -1.0e30, tl.float32)
    l_run = tl.zeros([G_POW2], tl.float32)
    acc = tl.zeros([G_POW2, D_PAD], tl.float32)
    for s0 in range(0, n_used, MERGE_SPLITS):
        ss = s0 + tl.arange(0, MERGE_SPLITS)
        rows = base[:, None] + ss[None, :]  # [G_POW2, MERGE_SPLITS]
        rm = gm[:, None] & (ss < n_used)[None, :]
        # NOTE: .cg: straight from L2, where the other programs' partials are
        m = tl.load(pml_ptr + rows * 2, mask=rm, other=-1.0e30, cache_modifier=".cg")
        lsum = tl.load(pml_ptr + rows * 2 + 1, mask=rm, other=0.0, cache_modifier=".cg")
        o = tl.load(
            po_ptr + rows[:, :, None] * D_PAD + d[None, None, :],
            mask=rm[:, :, None],
            other=0.0,
            cache_modifier=".cg",
        )
        m_new = tl.maximum(m_run, tl.max(m, axis=1))
        alpha = tl.exp2(m_run - m_new)
        w = tl.exp2(m - m_new[:, None])
        l_run = l_run * alpha + tl.sum(w * lsum, axis=1)
        acc = acc * alpha[:, None] + tl.sum(w[:, :, None] * o, axis=1)
        m_run = m_new
    l_run = tl.where(l_run > 0.0, l_run, 1.0)
    tl.store(
        out_ptr + b.to(tl.int64) * sot + heads[:, None] * soh + d[None, :],
        out_values(acc / l_run[:, None], q_ptr, out_ptr, os_ptr, QUANT_OUT),
        mask=gm[:, None] & (d < HD)[None, :],
    )


def empty_out(q: torch.Tensor, out_scale: torch.Tensor | None) -> torch.Tensor:
    """The attention output buffer: q's shape, in q's dtype or FP8 (quantized with out_scale;
    then with room for the rows the FP8 o projection may pad it to: `row_room`)."""
    if out_scale is None:
        return torch.empty(q.shape, dtype=q.dtype, device=q.device)
    flat = empty_rows(q.shape[0], math.prod(q.shape[1:]), torch.float8_e4m3fn, q.device)
    return flat.view(q.shape)


def merge_splits(g: int, d_pad: int, num_warps: int) -> int:
    """Splits the last program merges per step: ~32 fp32 registers per thread for its
    [G_POW2, MERGE_SPLITS, D_PAD] partials tile (a power of two)."""
    return max(1, 32 * 32 * num_warps // (triton.next_power_of_2(g) * d_pad))


def launch_decode(
    q,
    k_cache,
    v_cache,
    block_tables,
    context_lens,
    scale,
    window,
    max_context_len,
    out,
    params,
    k_scale=None,
    v_scale=None,
    seq0=0,
    out_scale=None,
    new_v=None,
    qsl=None,
) -> None:
    """q: [B, Hq, hd] (one query per sequence: row b is sequence seq0 + b of block_tables and
    context_lens). `window` <= 0: none. `max_context_len` (an upper bound is fine) sizes the
    split grid. k_scale / v_scale: an FP8 KV cache's scales (float32 []) or None (then the
    kernel is the plain one). out_scale: out is float8_e4m3fn, the output quantized with it.
    new_v: [B, Hkv, hd], each row's newest V, stored into the cache first (reference.py).
    qsl: a step's query_start_loc [B + 1] with q and out [T, Hq, hd]: each of the B sequences
    with one query attends, at its row (ANY_DECODES), the others are left to the prefill
    kernel."""
    B, hq, hd = q.shape
    if qsl is not None:
        B = qsl.shape[0] - 1
    hkv = k_cache.shape[2]
    if B == 0:
        return
    g = hq // hkv
    part = int(params.get("partition", 256))
    block_n = min(int(params.get("block_n", 64)), part)
    num_warps = int(params.get("num_warps", 4))
    num_stages = int(params.get("num_stages", 2))
    target = int(params["programs"]) if "programs" in params else None
    split_min = split_min_keys(params, block_n)
    num_splits = split_plan(B * hkv, max_context_len, max(part, split_min), target)
    d_pad = max(16, triton.next_power_of_2(hd))
    split = num_splits > 1
    if split:
        po = torch.empty((B, hq, num_splits, d_pad), dtype=torch.float32, device=q.device)
        pml = torch.empty((B, hq, num_splits, 2), dtype=torch.float32, device=q.device)
        cnt = _counters(B * hkv, q.device)
    else:
        po = pml = cnt = out
    use_window = window > 0
    fp8 = k_scale is not None and v_scale is not None
    v_t = check_kv_layout(k_cache, v_cache, "paged_attention")
    _decode_kernel[(B, hkv, num_splits)](
        q,
        k_cache,
        v_cache,
        k_scale if fp8 else None,
        v_scale if fp8 else None,
        block_tables,
        context_lens,
        out,
        po,
        pml,
        cnt,
        out_scale,
        new_v,
        qsl,
        float(scale) * LOG2E,
        int(window),
        g,
        hd,
        k_cache.shape[1],
        num_splits,
        seq0,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        new_v.stride(0) if new_v is not None else 0,
        new_v.stride(1) if new_v is not None else 0,
        V_T=v_t,
        SPLIT=split,
        USE_WINDOW=use_window,
        IEEE=q.dtype == torch.float32,
        KV_FP8=fp8,
        BLOCK_N=block_n,
        G_PAD=max(16, triton.next_power_of_2(g)),
        D_PAD=d_pad,
        G_POW2=triton.next_power_of_2(g),
        MERGE_SPLITS=merge_splits(g, d_pad, num_warps),
        QUANT_OUT=out_scale is not None,
        WRITE_V=new_v is not None,
        SEG=math.gcd(k_cache.shape[1], 32),  # a sector of FP8 tokens, or a block's share of it
        SPLIT_MIN=split_min,
        QSL_ROWS=qsl is not None,
        # tiles inside one block only (the block-table entry is the tile's)
        BT_AHEAD=bool(params.get("bt_ahead")) and k_cache.shape[1] % block_n == 0,
        num_warps=num_warps,
        num_stages=num_stages,
        **launch_options(),
    )


# Decode launches bounded by at most SHORT_CONTEXT keys (`max_context_len`; layout.py) run a
# tactic's short-context decode tactic when it has one: the build times the decode tactics at
# 256 keys under this bound (a smaller split grid), and the decode graphs of small batches are
# captured at it too (runtime/cuda_graphs.py). Why: the tactic fastest over 256 and 2,048 keys
# ran 6.66 us a layer at 256 where another ran 6.12 (H200, BF16 Llama-3.1-8B, 2026-12-05).


def combine_tactics(
    decode: Tactic,
    prefill: Tactic,
    large: Tactic | None = None,
    short: Tactic | None = None,
    short_prefill: Tactic | None = None,
) -> Tactic:
    """One paged_attention tactic from a decode tactic, a prefill tactic and optionally a
    decode tactic for large batches (LARGE_BATCH_ROWS; without one `decode` serves all), one
    for short contexts (SHORT_CONTEXT; without one `decode` serves them) and a prefill tactic
    for launches of short prompts (SHORT_PROMPT; without one `prefill` serves them)."""
    return joined_tactic(("dec_", decode, ""), ("pf_", prefill, ""), ("decl_", large, "large:"),
                         ("decs_", short, "short:"), ("pfs_", short_prefill, "prompts:"))  # fmt: skip


PAGED_ATTENTION_TACTICS: tuple[Tactic, ...] = tuple(
    [combine_tactics(DECODE_TACTICS[0], p) for p in PREFILL_TACTICS]
    + [combine_tactics(dt, PREFILL_TACTICS[0]) for dt in DECODE_TACTICS[1:]]
    + [combine_tactics(DECODE_TACTICS[0], PREFILL_TACTICS[0], DECODE_TACTICS[-2])]
)


def _split_params(tactic: Tactic | None) -> tuple[dict, dict, dict, dict, dict]:
    """(decode, large-batch decode, prefill, short-context decode, short-prompt prefill)
    params of a paged_attention tactic."""
    p = tactic.as_dict() if tactic is not None else {}

    def part(prefix: str) -> dict:
        return {k[len(prefix) :]: v for k, v in p.items() if k.startswith(prefix)}

    dec = part("dec_") or DECODE_TACTICS[0].as_dict()
    pf = part("pf_") or PREFILL_TACTICS[0].as_dict()
    return dec, part("decl_") or dec, pf, part("decs_") or dec, part("pfs_") or pf


def make_decode_attention(tactic: Tactic | None = None):
    """The decode kernel alone: q [B, Hq, hd], exactly one query per sequence."""
    params = (tactic or DECODE_TACTICS[0]).as_dict()

    def decode_attention(
        q,
        k_cache,
        v_cache,
        block_tables,
        context_lens,
        query_start_loc,
        scale,
        sliding_window=None,
        *,
        max_context_len=None,
        out=None,
        k_scale=None,
        v_scale=None,
        new_v=None,
    ):
        out = torch.empty_like(q) if out is None else out
        if max_context_len is None:
            max_context_len = block_tables.shape[1] * k_cache.shape[1]
        launch_decode(
            q,
            k_cache,
            v_cache,
            block_tables,
            context_lens,
            scale,
            int(sliding_window) if sliding_window else 0,
            int(max_context_len),
            out,
            params,
            k_scale,
            v_scale,
            new_v=new_v,
        )
        return out

    return decode_attention


# EXPERIMENT, for A/Bs of the engines' speed (scripts/bench_quant.sh TPUT_AB_ENV), not an engine
# option: with INGOT_FP8_QUERIES=1 an FP8-cache engine's prefill kernel runs with fp8_queries (Q.K
# on FP8 tensor cores, each query row rounded to FP8) over the sequences it takes (the reference's
# prefill_seqs); the routes stay as they are. CPU engines (the reference) ignore it, and engines
# built without it compile the kernel variant at first use.
FP8_QUERIES_ENV = "INGOT_FP8_QUERIES"
# EXPERIMENT, an A/B switch as the one above: with INGOT_FP8MMA_DECODE=1 an FP8-cache engine's
# large-batch decode launches (at least LARGE_BATCH_ROWS sequences x kv heads, V transposed, no
# window, the engine storing V itself) run triton_decode_fp8mma (both dots on FP8 tensor cores,
# the queries and P in two FP8 terms each) instead of the decode kernel; values like
# "n64_w4_s2" pick its variant, and "n64_w4_s2_x1" rounds the queries and P once.
FP8MMA_ENV = "INGOT_FP8MMA_DECODE"
# EXPERIMENT, an A/B switch as the two above: INGOT_LARGE_DECODE_TACTIC=<a DECODE_TACTICS name>
# replaces the engine's large-batch decode tactic, so two picks are compared on one engine in
# one device call (the build's pick changes only with a rebuild).
LARGE_DECODE_ENV = "INGOT_LARGE_DECODE_TACTIC"


# The same for the short-prompt prefill tactic: INGOT_SHORT_PROMPT_TACTIC=<a prefill tactic
# name>, or `long` for the 2,048-token pick (as engines without a short-prompt tactic run).
SHORT_PROMPT_ENV = "INGOT_SHORT_PROMPT_TACTIC"


def _env_tactic(env: str, tactics: tuple[Tactic, ...], kind: str) -> dict | None:
    """The params of the tactic named by environment variable `env`, or None when unset."""
    name = os.environ.get(env)
    if not name:
        return None
    for t in tactics:
        if t.name == name:
            return t.as_dict()
    names = ", ".join(t.name for t in tactics)
    raise ValueError(f"{env}={name} is not a {kind} tactic; one of: {names}")


def _large_decode_override() -> dict | None:
    """LARGE_DECODE_ENV's tactic params, or None when it is unset."""
    return _env_tactic(LARGE_DECODE_ENV, DECODE_TACTICS, "decode")


def _short_prompt_override(long: dict) -> dict | None:
    """SHORT_PROMPT_ENV's tactic params (`long`'s for `long`), or None when it is unset."""
    if os.environ.get(SHORT_PROMPT_ENV) == "long":
        return long
    return _env_tactic(SHORT_PROMPT_ENV, PREFILL_TACTICS + SHORT_PROMPT_TACTICS, "prefill")


def _fp8mma_variant(rows: int, k_scale, v_cache, window: int, new_v) -> dict | None:
    """The FP8-MMA experiment's launch parameters for a decode launch, or None to run the
    decode kernel (FP8MMA_ENV unset, or a launch it does not take)."""
    value = os.environ.get(FP8MMA_ENV)
    if not value or k_scale is None or window or new_v is not None or rows < LARGE_BATCH_ROWS:
        return None
    if not is_transposed(v_cache):
        return None
    if value == "1":
        return {}
    n, w, st, *terms = (int(x[1:]) for x in value.split("_"))
    return {"block_n": n, "num_warps": w, "num_stages": st, "two_term": terms != [1]}


def make_paged_attention(tactic: Tactic | None = None):
    dec_params, large_params, long_pf, short_params, short_pf = _split_params(tactic)

    def decode_params(rows: int, bound: int) -> dict:
        """The decode tactic for `rows` = sequences x kv heads under a context bound."""
        if rows >= LARGE_BATCH_ROWS:
            return _large_decode_override() or large_params
        return short_params if bound <= SHORT_CONTEXT else dec_params

    def paged_attention(
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
        max_context_len: int | None = None,
        out: torch.Tensor | None = None,
        k_scale: torch.Tensor | None = None,
        v_scale: torch.Tensor | None = None,
        num_decodes: int = 0,
        out_scale: torch.Tensor | None = None,
        new_v: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The reference's contract (q: [T, Hq, hd] packed -> [T, Hq, hd]), plus metadata:

        max_query_len: the longest q_len in the batch; 1 selects the decode kernel (then row b
            of q must be sequence b's query). If None it is derived with ONE host sync — pass it
            on the hot path (CUDA-graph capture forbids the sync).
        max_context_len: an upper bound on context_lens for sizing the decode split grid; None
            uses the block table's width * block size (no sync).
        out: optional [T, Hq, hd] output (e.g. a static buffer in a captured graph).
        k_scale / v_scale: an FP8 KV cache's scales (float32 []): the kernels multiply the
            float8_e4m3fn K/V by them on load; None: a plain cache (the kernels are unchanged).
        num_decodes: the last num_decodes sequences have one query each (a mixed step's
            decodes, known on the host); with max_query_len > 1 they run the decode kernel.
        out_scale: the output quantized to float8_e4m3fn with it (the reference's contract).
        new_v: the decode rows' V, stored by the decode kernel (the reference's contract).
        """
        out = empty_out(q, out_scale) if out is None else out
        window = int(sliding_window) if sliding_window else 0
        if max_query_len is None:
            if q.shape[0] == 0:
                return out
            # NOTE: host sync; the runtime passes max_query_len instead.
            max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max())
        pf_params = long_pf
        if max_query_len <= SHORT_PROMPT:
            pf_params = _short_prompt_override(long_pf) or short_pf
        B, T, hkv = context_lens.shape[0], q.shape[0], k_cache.shape[2]
        table_len = block_tables.shape[1] * k_cache.shape[1]
        nd = decode_rows(T, B, int(max_query_len), num_decodes)
        if new_v is not None:
            check_new_v(new_v, nd)
        fp8_queries = (
            k_scale is not None and q.dtype != torch.float32
            and os.environ.get(FP8_QUERIES_ENV) == "1"
        )  # fmt: skip
        if num_decodes == ANY_DECODES and nd < B:
            # one-query sequences anywhere in the step (a captured graph): the decode kernel
            # takes them at their rows, the prefill kernel skips them
            launch_prefill(
                q, k_cache, v_cache, block_tables, context_lens, query_start_loc, scale,
                window, int(max_query_len), out, pf_params, k_scale, v_scale, out_scale,
                skip_single=True, fp8_queries=fp8_queries,
            )  # fmt: skip
            launch_decode(
                q, k_cache, v_cache, block_tables, context_lens, scale, window, table_len, out,
                decode_params(B * hkv, table_len), k_scale, v_scale, out_scale=out_scale,
                qsl=query_start_loc,
            )  # fmt: skip
            return out
        if nd == B:
            bound = int(max_context_len or table_len)
            f8 = _fp8mma_variant(B * hkv, k_scale, v_cache, window, new_v)
            if f8 is not None:
                return decode_fp8mma(q, k_cache, v_cache, block_tables, context_lens, scale,
                                     k_scale, v_scale, out=out, out_scale=out_scale, **f8)  # fmt: skip
            launch_decode(
                q, k_cache, v_cache, block_tables, context_lens, scale, window, bound, out,
                decode_params(B * hkv, bound), k_scale, v_scale, out_scale=out_scale, new_v=new_v,
            )  # fmt: skip
            return out
        # the prefill kernel gives each sequence whole BLOCK_M-query tiles: the trailing
        # one-query rows of a mixed step go to the decode kernel instead (one launch each)
        launch_prefill(
            q[: T - nd], k_cache, v_cache, block_tables[: B - nd], context_lens[: B - nd],
            query_start_loc[: B - nd + 1], scale, window, int(max_query_len), out[: T - nd],
            pf_params, k_scale, v_scale, out_scale, fp8_queries=fp8_queries,
        )  # fmt: skip
        f8 = _fp8mma_variant(nd * hkv, k_scale, v_cache, window, new_v) if nd else None
        if f8 is not None:
            decode_fp8mma(q[T - nd :], k_cache, v_cache, block_tables[B - nd :],
                          context_lens[B - nd :], scale, k_scale, v_scale, out=out[T - nd :],
                          out_scale=out_scale, **f8)  # fmt: skip
        elif nd:
            # NOTE: split as the decode graphs do (the table's width): the same binaries
            launch_decode(
                q[T - nd :], k_cache, v_cache, block_tables, context_lens, scale, window,
                table_len, out[T - nd :], decode_params(nd * hkv, table_len), k_scale, v_scale,
                seq0=B - nd,
                out_scale=out_scale, new_v=new_v,
            )  # fmt: skip
        return out

    return paged_attention
