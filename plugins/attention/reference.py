"""Paged KV cache write and paged attention over a packed variable-length batch, plain torch.

KV cache layout (one layer): k_cache, v_cache: [num_blocks, block_size, Hkv, hd]. Token t of a
sequence lives in block block_table[t // block_size] at offset t % block_size. V may be a
permuted view (FP8 pools store it transposed per block: layout.py); only indexing is used here.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..quant.reference import quantize_fp8

FP8_MAX = 448.0  # largest finite float8_e4m3fn


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
    """Scatter k, v: [T, Hkv, hd] into the caches at flat slots [T] (block * block_size + off).

    k_scale / v_scale (float32 [], FP8 KV cache): store k / k_scale and v / v_scale saturated
    to float8_e4m3fn; attention multiplies them back. None: store k, v cast to the cache dtype.
    """
    fp8 = k_scale is not None and v_scale is not None
    write_cache(k, k_cache, slot_mapping, k_scale if fp8 else None)
    write_cache(v, v_cache, slot_mapping, v_scale if fp8 else None)


def write_cache(
    x: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor, scale: torch.Tensor | None
) -> None:
    """One of write_kv's halves: x [T, Hkv, hd] into `cache` at flat slots; with `scale`,
    quantized to float8_e4m3fn."""
    bs = cache.shape[1]
    slots = slots.long()
    if scale is not None:
        x = _to_fp8(x, scale)
    cache[slots // bs, slots % bs] = x.to(cache.dtype)


# num_decodes of a step whose one-query sequences the host does not know (a captured graph of
# a step with prompts, runtime/cuda_graphs.py): the GPU attention runs every one-query sequence,
# wherever it sits, with the decode kernel (a one-token prompt chunk too: the same attention)
ANY_DECODES = -1


def decode_rows(num_tokens: int, num_seqs: int, max_query_len: int, num_decodes: int) -> int:
    """How many sequences at the end of a step (one query row each, the last rows of q) the
    GPU attention runs as decodes: all of them in a decode-only step, else the mixed step's
    trailing `num_decodes` (the prefill kernel takes the rest; none with ANY_DECODES, whose
    decodes are not trailing rows). `new_v` of paged_attention holds the V of exactly these
    rows."""
    if max_query_len == 1 and num_tokens == num_seqs:
        return num_seqs
    return num_decodes if 0 < num_decodes < num_seqs else 0


def prefill_seqs(query_start_loc: torch.Tensor, num_decodes: int) -> torch.Tensor:
    """[B] bool: the sequences of a step the GPU's prefill kernel attends, the others being
    the decode kernel's (decode_rows; with ANY_DECODES, every one-query sequence)."""
    lens = query_start_loc[1:] - query_start_loc[:-1]
    if num_decodes == ANY_DECODES:
        return lens > 1
    b = lens.shape[0]
    nd = decode_rows(int(lens.sum()), b, int(lens.max()) if b else 0, num_decodes)
    return torch.arange(b, device=lens.device) < b - nd


def write_decode_v(
    new_v: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    v_scale: torch.Tensor | None,
) -> None:
    """new_v [n, Hkv, hd]: the V of the last n sequences' newest token (position ctx - 1),
    written where their block tables put it."""
    n = new_v.shape[0]
    if n == 0:
        return
    bs = v_cache.shape[1]
    pos = context_lens[-n:].long() - 1
    blk = block_tables[-n:].long().gather(1, (pos // bs)[:, None])[:, 0]
    write_cache(new_v, v_cache, blk * bs + pos % bs, v_scale)


def _to_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (x.float() / scale.float()).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def _gather_dequant(
    cache: torch.Tensor, block_table: torch.Tensor, length: int, scale: torch.Tensor | None, dtype
) -> torch.Tensor:
    """gather_kv cast to `dtype`; an FP8 cache is multiplied by its scale (in fp32) first."""
    kv = gather_kv(cache, block_table, length)
    if scale is None:
        return kv.to(dtype)
    return (kv.float() * scale.float()).to(dtype)


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """One sequence's first `length` cached tokens: [length, Hkv, hd]."""
    bs = cache.shape[1]
    n_blocks = (length + bs - 1) // bs
    blocks = cache[block_table[:n_blocks].long()]  # [n, bs, Hkv, hd]
    return blocks.reshape(n_blocks * bs, *cache.shape[2:])[:length]


def fp8_query_rows(q: torch.Tensor) -> torch.Tensor:
    """q [T, H, hd] with each row (one query of one head) times 448 / amax rounded to
    float8_e4m3fn, then times amax / 448 (both 1 for a row of amax <= 1e-30), back in q's
    dtype: the queries an FP8 Q.K dot sees (triton_prefill.fp8_query), exactly: the kernel
    scales and rounds the same way."""
    qf = q.float()
    amax = qf.abs().amax(-1, keepdim=True)
    one = torch.ones_like(amax)
    big = amax > 1e-30  # as the kernel: 448 / amax would overflow for the tiniest rows
    inv = torch.where(big, FP8_MAX / amax, one)
    sq = torch.where(big, amax / FP8_MAX, one)
    q8 = (qf * inv).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return (q8.float() * sq).to(q.dtype)


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
    fp8_queries: bool = False,
) -> torch.Tensor:
    """Causal attention of each sequence's new queries over its whole cached context.

    q: [T, Hq, hd] packed; sequence b owns rows query_start_loc[b]:query_start_loc[b+1], which
    are its last positions (context_lens[b] - q_len ... context_lens[b] - 1). The KV of those
    positions must already be written. GQA: Hq is a multiple of Hkv.
    sliding_window: a query at position i sees keys j with i - sliding_window < j <= i.
    max_query_len / max_context_len: batch metadata GPU kernels use to size their grids (the
    reference derives what it needs), as is num_decodes (how many sequences at the end have
    one query each, or ANY_DECODES). out: optional [T, Hq, hd] result buffer.
    k_scale / v_scale: an FP8 KV cache's scales (see write_kv); None for a plain cache.
    out_scale: the result in q.dtype is quantized to float8_e4m3fn with it (float32 []), as the
    FP8 o projection quantizes its input (quant/reference.py: quantize_fp8).
    new_v: [n, Hkv, hd], n = decode_rows(...): the V of the step's decode rows, not yet in the
    cache; written first (at position ctx - 1, quantized as write_kv does). The GPU decode
    kernel stores it with the block's other tokens, in whole 32-byte sectors (an FP8 pool's
    transposed V takes one byte per row of 32: a scattered one-byte write costs far more).
    fp8_queries: the queries of the sequences the GPU's prefill kernel attends (Q.K in FP8)
    rounded to FP8 per row first (fp8_query_rows; an FP8 cache): every sequence but the step's
    decode rows (decode_rows), and with ANY_DECODES every sequence of more than one query.
    Returns [T, Hq, hd] in q.dtype (float8_e4m3fn with out_scale).
    """
    if fp8_queries:
        if k_scale is None:
            raise ValueError("paged_attention: fp8_queries needs an FP8 KV cache")
        lens = query_start_loc[1:] - query_start_loc[:-1]
        rounded = torch.repeat_interleave(prefill_seqs(query_start_loc, num_decodes), lens.long())
        q = torch.where(rounded[:, None, None], fp8_query_rows(q), q)
        return paged_attention(
            q, k_cache, v_cache, block_tables, context_lens, query_start_loc,
            scale, sliding_window, max_query_len=max_query_len, max_context_len=max_context_len,
            out=out, k_scale=k_scale, v_scale=v_scale, num_decodes=num_decodes,
            out_scale=out_scale, new_v=new_v,
        )  # fmt: skip
    if new_v is not None:
        if max_query_len is None:
            max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max())
        n = decode_rows(q.shape[0], context_lens.shape[0], max_query_len, num_decodes)
        check_new_v(new_v, n)
        write_decode_v(new_v, v_cache, block_tables, context_lens, v_scale)
    if out_scale is not None:
        kw = dict(max_query_len=max_query_len, max_context_len=max_context_len)
        o = paged_attention(q, k_cache, v_cache, block_tables, context_lens, query_start_loc,
                            scale, sliding_window, k_scale=k_scale, v_scale=v_scale, **kw)  # fmt: skip
        o = quantize_fp8(o, out_scale)
        return o if out is None else out.copy_(o)
    out = torch.empty_like(q) if out is None else out
    hq = q.shape[1]
    starts = query_start_loc.tolist()
    lens = context_lens.tolist()
    for b, ctx in enumerate(lens):
        q0, q1 = starts[b], starts[b + 1]
        if q1 == q0:
            continue
        # NOTE: 4-D with a batch of one: CPU SDPA takes another kernel for 3-D inputs.
        if k_scale is None:
            k = gather_kv(k_cache, block_tables[b], ctx).to(q.dtype)
            v = gather_kv(v_cache, block_tables[b], ctx).to(q.dtype)
        else:  # FP8 KV cache
            k = _gather_dequant(k_cache, block_tables[b], ctx, k_scale, q.dtype)
            v = _gather_dequant(v_cache, block_tables[b], ctx, v_scale, q.dtype)
        k = k.transpose(0, 1)[None].contiguous()
        v = v.transpose(0, 1)[None].contiguous()
        qb = q[q0:q1].transpose(0, 1)[None]  # [1, Hq, n, hd]
        n = q1 - q0
        gqa = hq != k.shape[1]
        if sliding_window is None or ctx <= sliding_window:
            # NOTE: the two mask-free SDPA calls a plain causal model makes (whole prompt;
            # one new token), so results match transformers bit for bit where it can.
            if n == ctx or n == 1:
                o = F.scaled_dot_product_attention(
                    qb, k, v, is_causal=n > 1, scale=scale, enable_gqa=gqa
                )
                out[q0:q1] = o[0].transpose(0, 1)
                continue
        qpos = torch.arange(ctx - n, ctx, device=q.device)[:, None]
        kpos = torch.arange(ctx, device=q.device)[None, :]
        mask = kpos <= qpos
        if sliding_window is not None:
            mask &= kpos > qpos - sliding_window
        o = F.scaled_dot_product_attention(qb, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)
        out[q0:q1] = o[0].transpose(0, 1)
    return out


def check_new_v(new_v: torch.Tensor, n: int) -> None:
    if new_v.shape[0] != n:
        raise ValueError(f"paged_attention: new_v has {new_v.shape[0]} rows for {n} decode rows")


def make_write_kv(tactic=None):
    return write_kv


def make_paged_attention(tactic=None):
    return paged_attention
