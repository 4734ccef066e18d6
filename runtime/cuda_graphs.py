"""Decode steps replayed from CUDA graphs captured per batch-size bucket.

A decode-only step of B sequences runs the graph of the smallest bucket >= B. Rows past B are
padding: they write their KV into the cache's scratch block and attend to one scratch token, so
they never touch a real sequence. All of a step's inputs travel in one pinned host buffer and
one copy; the graph also takes the argmax, so a greedy step reads back B integers.

A step with prompt tokens of up to 64 sequences (PrefillGraphs) runs the graph of the
smallest token bucket and sequence tier that hold it, padded the same way.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import TypeVar

import numpy as np
import torch

from ingot.plugins.attention.reference import ANY_DECODES

from .kv_cache import KVCache
from .memory import PREFILL_GRAPH_TOKENS
from .model import AttnMetadata, Decoder, SampleRows
from .sampler import greedy_tokens
from .step_inputs import recorded_event, segments

K = TypeVar("K", bound=Hashable)  # a graph's key: batch size, or (sequences, tokens)


def batch_buckets(max_batch_size: int) -> list[int]:
    """1, 2, 4, 8, then steps of 8 up to 64, steps of 64 up to 512, steps of 128 up to 1,024,
    then powers of two, always ending at the maximum."""
    # NOTE: steps of 64 to 512: a batch padded to the next power of two ran its GEMMs on up to
    # twice its rows, and its decode attention with too few splits (435 sequences padded to
    # 512 got one: the engine's step 20% slower than at 448 in two, H200, 2,048 / 2,048)
    sizes = [b for b in (1, 2, 4) if b < max_batch_size]
    b = 8
    while b < max_batch_size:
        sizes.append(b)
        b = b + 8 if b < 64 else b + 64 if b < 512 else b + 128 if b < 1024 else b * 2
    return sizes + [max_batch_size]


def pinned_int32(sizes: list[int], device: torch.device) -> tuple[torch.Tensor, list[np.ndarray]]:
    """A host buffer (pinned for a CUDA device) of int32 segments of `sizes`, laid out as
    `packed_int32` lays out its device buffer: (host, host views)."""
    starts, end = segments(sizes)
    host = torch.empty(end, dtype=torch.int32, pin_memory=device.type == "cuda")
    h = host.numpy()
    return host, [h[a : a + n] for a, n in zip(starts, sizes, strict=True)]


def packed_int32(
    sizes: list[int], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, list[np.ndarray], list[torch.Tensor]]:
    """One pinned host buffer and one device buffer (int32) holding segments of `sizes`, so a
    step's inputs travel in one copy: (host, dev, host views, device views). Each segment
    starts 16-byte aligned, as Triton specializes kernels on pointer alignment (an unaligned
    view would need a kernel the engine's ahead-of-time bundle does not hold)."""
    starts, end = segments(sizes)
    host, h = pinned_int32(sizes, device)
    dev = torch.empty(end, dtype=torch.int32, device=device)
    return host, dev, h, [dev[a : a + n] for a, n in zip(starts, sizes, strict=True)]


def capture_graphs(
    buckets: list[K],
    run: Callable[[K], tuple[torch.Tensor, ...]],
    prepare: Callable[[K], None] | None = None,
) -> tuple[dict[K, torch.cuda.CUDAGraph], dict[K, tuple[torch.Tensor, ...]]]:
    """One graph of `run(b)` per bucket, and the tensors each graph writes its results to.

    `buckets` smallest first; captured largest first, so the smaller graphs reuse its memory
    pool. `prepare(b)` runs before each bucket's warm-up, which really executes, so the static
    inputs must be valid for it.
    """
    graphs: dict[K, torch.cuda.CUDAGraph] = {}
    outputs: dict[K, tuple[torch.Tensor, ...]] = {}
    pool = None
    for b in reversed(buckets):
        if prepare is not None:
            prepare(b)
        # NOTE: warm-up outside capture: kernels load here, never inside the capture.
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            run(b)
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=pool):
            outputs[b] = run(b)
        pool = g.pool()
        graphs[b] = g
    torch.cuda.synchronize()
    return graphs, outputs


# With a short tier, decode graphs of at most this many sequences are captured twice: at the
# engine's context bound and at SHORT_CONTEXT, which steps whose contexts all fit run (their
# attention launches a smaller split grid with the short-context decode tactic;
# plugins/attention/triton_decode.py)
SHORT_TIER_MAX_BATCH = 8
# The short tier's bound by default: None, off. On an H100 it cost 0.6% at batch 1 (190.2-190.5
# tok/s without it, 189.1-189.2 with it, one process; docs/performance.md 2026-12-05 06:00)
# though its attention launch timed faster; not yet measured on the H200 (the bench A/B's
# `short_tier` variant). Builds still time its tactic and bundle its kernels, so turning it on
# (SHORT_CONTEXT) needs no rebuild.
SHORT_TIER: int | None = None


class DecodeGraphs:
    """Captured decoder.forward + logits + argmax for decode-only steps.

    short_context: the bound of the second tier of small-batch graphs (None or not below
    max_context_len: none)."""

    def __init__(
        self,
        decoder: Decoder,
        kv: KVCache,
        max_batch_size: int,
        max_blocks_per_seq: int,
        max_context_len: int,
        device: torch.device,
        short_context: int | None = None,
    ) -> None:
        self.decoder, self.kv = decoder, kv
        self.buckets = batch_buckets(max_batch_size)
        short = short_context is not None and short_context < max_context_len
        self.short_context = short_context if short else None
        self.short_buckets = [b for b in self.buckets if short and b <= SHORT_TIER_MAX_BATCH]
        n, w = max_batch_size, max_blocks_per_seq
        # ids | positions | slots | context lens | block tables [n, w]
        sizes = [n, n, n, n, n * w]
        self.host, self.dev, h, d = packed_int32(sizes, device)
        # NOTE: a pipelined executor stages step k+1 while step k's copy may still be queued:
        # two pinned buffers, used in turn, each with the event of its last copy
        self._stages = [(self.host, h), pinned_int32(sizes, device)]
        self._copied: list[torch.cuda.Event | None] = [None, None]
        self._turn = 0
        self._use_stage(0)
        self.ids, self.pos, self.slots, self.ctx = d[:4]
        self.tables = d[4].view(n, w)
        # a bucket's graph reads rows [:bucket] only: a step copies the buffer up to the end of
        # those table rows (the tables are the last segment), not all max_batch_size rows
        self._tables_at, self._width = d[4].storage_offset(), w
        self.qsl = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.max_context_len = max_context_len
        self._capture_all()

    def _use_stage(self, i: int) -> None:
        self.host, h = self._stages[i]
        self.h_ids, self.h_pos, self.h_slots, self.h_ctx = h[:4]
        self.h_tables = h[4].reshape(len(self.h_ids), -1)

    def _meta(self, b: int, bound: int) -> AttnMetadata:
        return AttnMetadata(self.slots[:b], self.tables[:b], self.ctx[:b], self.qsl[: b + 1],
                            bound, 1)  # fmt: skip

    def _run(self, b: int, bound: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        meta = self._meta(b, bound or self.max_context_len)
        hidden = self.decoder.forward(self.ids[:b], self.pos[:b], meta, self.kv)
        logits = self.decoder.step_logits(hidden)
        return logits, greedy_tokens(logits)

    def _pad_rows(self, start: int, stop: int | None = None) -> None:
        """Point rows [start:stop] at the scratch block (host side)."""
        scratch = self.kv.scratch_block
        rows = slice(start, stop)
        self.h_ids[rows] = 0
        self.h_pos[rows] = 0
        self.h_slots[rows] = scratch * self.kv.tokens_per_block
        self.h_ctx[rows] = 1
        self.h_tables[rows] = scratch

    def _capture_all(self) -> None:
        self._pad_rows(0)
        self.dev.copy_(self.host)
        # each bucket's graph writes (logits, argmax) into its outputs
        self.graphs, self.outputs = capture_graphs(self.buckets, self._run)
        self.short_graphs, self.short_outputs = {}, {}
        if self.short_buckets:
            self.short_graphs, self.short_outputs = capture_graphs(
                self.short_buckets, lambda b: self._run(b, self.short_context)
            )

    def can_run(self, num_seqs: int) -> bool:
        return num_seqs <= self.buckets[-1]

    def run(self, plan, ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """plan: a decode-only StepPlan of B sequences -> (logits [B, V], argmax [B]),
        views valid until the next run. ids: the input tokens on the device (int32 [B]),
        instead of the plan's (a pipelined decode: the previous step's argmax)."""
        b = plan.num_seqs
        bucket = next(x for x in self.buckets if x >= b)
        i = self._turn = 1 - self._turn
        if self._copied[i] is not None:
            self._copied[i].synchronize()  # NOTE: copied two steps ago; normally long done
        self._use_stage(i)
        self.h_ids[:b] = plan.input_ids
        self.h_pos[:b] = plan.positions
        self.h_slots[:b] = plan.slot_mapping
        self.h_ctx[:b] = plan.context_lens
        self.h_tables[:b] = plan.block_tables
        self._pad_rows(b, bucket)
        end = self._tables_at + bucket * self._width
        self.dev[:end].copy_(self.host[:end], non_blocking=True)
        self._copied[i] = recorded_event(self.dev.device)
        if ids is not None:
            self.ids[:b].copy_(ids)
        graphs, outputs = self.graphs, self.outputs
        if bucket in self.short_graphs and int(np.max(plan.context_lens)) <= self.short_context:
            graphs, outputs = self.short_graphs, self.short_outputs
        graphs[bucket].replay()
        logits, greedy = outputs[bucket]
        return logits[:b], greedy[:b]


# Prefill graphs: powers of two up to SMALL_PREFILL (launch-bound prompts: padding is cheap
# there), then steps of LARGE_PREFILL_STEP up to LARGE_PREFILL. A large bucket runs only prompts
# it pads by at most LARGE_PAD_MAX tokens: each padded token costs its share of the step's
# GEMMs (~21 us per token on the H200 at 8B shapes), which outgrows the host's launch time
# (the graph's gain, a few ms) past ~100 tokens.
SMALL_PREFILL = 512
LARGE_PREFILL_STEP = 256
LARGE_PREFILL = PREFILL_GRAPH_TOKENS  # runtime/memory.py reserves their pool
LARGE_PAD_MAX = 64


def prefill_buckets(max_num_tokens: int, largest: int = LARGE_PREFILL) -> list[int]:
    """Token counts of the captured single-prompt prefill graphs: 16, 32, ... SMALL_PREFILL,
    then steps of LARGE_PREFILL_STEP up to `largest`, none past `max_num_tokens`."""
    cap = min(largest, max_num_tokens)
    sizes, t = [], 16
    while t <= min(SMALL_PREFILL, cap):
        sizes.append(t)
        t *= 2
    t = SMALL_PREFILL + LARGE_PREFILL_STEP
    while t <= cap:
        sizes.append(t)
        t += LARGE_PREFILL_STEP
    return sizes


def prefill_bucket(buckets: list[int], tokens: int) -> int | None:
    """The graph bucket a lone prompt chunk of `tokens` runs in, or None (run it eagerly):
    the smallest bucket that holds it, unless that is a large one padding it by more than
    LARGE_PAD_MAX tokens."""
    b = next((x for x in buckets if x >= tokens), None)
    if b is None or (b > SMALL_PREFILL and b - tokens > LARGE_PAD_MAX):
        return None
    return b


# Sequence tiers of the prefill graphs, (sequences, largest token bucket): a step with prompt
# tokens runs in the graph of the smallest tier that holds its sequences at its bucket. Several
# prompts that arrive together, or a prompt's chunk beside requests that are decoding (a mixed
# step), then run captured too: eagerly, op by op from Python, a 128-token prefill step took
# 38-55 ms on the H100 against ~5 ms in its graph (docs/performance.md, 2026-12-05 evening),
# and every decoding request waits for it. Tier 64 (the default max_batch_size) stops at
# SMALL_PREFILL tokens: past that the step's GPU time outgrows the host's launch time.
PREFILL_GRAPH_TIERS = ((1, LARGE_PREFILL), (8, LARGE_PREFILL), (64, SMALL_PREFILL))


def prefill_graph_keys(buckets: list[int], max_batch_size: int) -> list[tuple[int, int]]:
    """(sequences, tokens) of the captured prefill graphs, by tokens then sequences: each
    tier of PREFILL_GRAPH_TIERS (capped at max_batch_size) at each of `buckets` up to its
    limit."""
    keys = {(min(s, max_batch_size), b) for s, top in PREFILL_GRAPH_TIERS for b in buckets
            if b <= top}  # fmt: skip
    return sorted(keys, key=lambda k: (k[1], k[0]))


class PrefillGraphs:
    """Captured prefill steps of up to `buckets[-1]` tokens from up to `tiers[-1]` sequences
    (the time to first token of short prompts is launch-bound when run op by op from Python; a
    long one still loses the host's launch time in its first layers, before the host gets
    ahead).

    Graphs are keyed (tier, bucket) (`prefill_graph_keys`): a tier-s graph runs steps of at
    most s sequences, with slots for s. The real sequences take the first slots; the slots
    left hold empty sequences, and one more sequence fills the bucket with padding tokens.
    Both live in the scratch block: they write to and read from it only. Each graph samples s
    rows: the step's sampling rows first, then rows of the padding sequence (discarded).

    A mixed step's decodes run the decode kernel, as they do eagerly: the graph cannot know
    which sequences decode, so in graphs of several sequences attention takes every
    one-query sequence to the decode kernel and every other one to the prefill kernel, each
    kernel's programs finding out from the query offsets (`AttnMetadata.num_decodes`
    ANY_DECODES). Before, a decode there ran the prefill kernel: a whole query tile over its
    whole context in one program a head, without the decode kernel's context splits.
    """

    def __init__(
        self,
        decoder: Decoder,
        kv: KVCache,
        keys: list[tuple[int, int]],
        max_blocks_per_seq: int,
        device: torch.device,
    ) -> None:
        self.decoder, self.kv, self.keys = decoder, kv, keys  # smallest first
        self.buckets = sorted({b for _, b in keys})
        self.tiers = sorted({s for s, _ in keys})
        s, n, w = self.tiers[-1], self.buckets[-1], max_blocks_per_seq
        # ids | positions | slots [n] | ctx [s+1] | qsl [s+2] | last | seqs [s] | tables [s+1, w]
        self.host, self.dev, h, d = packed_int32([n, n, n, s + 1, s + 2, s, s, (s + 1) * w], device)
        self.h = h[:7] + [h[7].reshape(s + 1, w)]
        self.d = d[:7] + [d[7].view(s + 1, w)]
        # a tier's graph reads table rows [:tier + 1] only: a step copies the buffer up to there
        self._tables_at, self._width = d[7].storage_offset(), w
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.out: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self._copied: torch.cuda.Event | None = None  # the last copy out of `host`
        self._fill_dummy(self.keys[-1])
        self._capture_all()

    def _fill(self, key: tuple[int, int], ids, pos, slots, ctx, qsl, tables, rows) -> None:
        """The host inputs of graph `key` for a step of len(ctx) sequences: their tokens'
        ids, positions and KV slots, context lengths, query start offsets, block tables, and
        the indices of the sequences that sample (`rows`)."""
        tier, bucket = key
        h_ids, h_pos, h_slots, h_ctx, h_qsl, h_last, h_seqs, h_tables = self.h
        scratch = self.kv.scratch_block
        n, t, r = len(ctx), len(ids), len(rows)
        h_ids[:t], h_pos[:t], h_slots[:t] = ids, pos, slots
        h_ids[t:bucket], h_pos[t:bucket] = 0, 0
        h_slots[t:bucket] = scratch * self.kv.tokens_per_block
        h_ctx[:n], h_qsl[: n + 1], h_tables[:n] = ctx, qsl, tables
        h_ctx[n:tier], h_qsl[n + 1 : tier + 1] = 1, t  # empty sequences
        h_ctx[tier], h_qsl[tier + 1] = max(bucket - t, 1), bucket  # the padding sequence
        h_tables[n : tier + 1] = scratch
        h_last[:r], h_seqs[:r] = np.asarray(qsl)[np.asarray(rows) + 1] - 1, rows
        h_last[r:tier], h_seqs[r:tier] = bucket - 1, tier

    def _run(self, key: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
        tier, bucket = key
        ids, pos, slots, ctx, qsl, last, seqs, tables = self.d
        # a lone prompt's graph (tier 1) has no decodes
        meta = AttnMetadata(
            slots[:bucket], tables[: tier + 1], ctx[: tier + 1], qsl[: tier + 2],
            tables.shape[1] * self.kv.tokens_per_block, bucket,
            num_decodes=ANY_DECODES if tier > 1 else 0,
        )  # fmt: skip
        rows = SampleRows(last[:tier], seqs[:tier])
        hidden = self.decoder.forward(ids[:bucket], pos[:bucket], meta, self.kv, rows)
        logits = self.decoder.step_logits(hidden)
        return logits, greedy_tokens(logits)

    def _fill_dummy(self, key: tuple[int, int]) -> None:
        """A one-token "prompt" that lives in the scratch block, padded to the bucket."""
        scratch, w = self.kv.scratch_block, self.h[-1].shape[1]
        slot = scratch * self.kv.tokens_per_block
        one, table = np.ones(1, np.int32), np.full((1, w), scratch, np.int32)
        self._fill(key, one * 0, one * 0, one * slot, one, [0, 1], table, one * 0)
        self.dev.copy_(self.host)

    def _capture_all(self) -> None:
        self.graphs, self.out = capture_graphs(self.keys, self._run, self._fill_dummy)

    def key(self, plan, rows: np.ndarray) -> tuple[int, int] | None:
        """The graph a step with prompt tokens runs in, sampling `rows` (at least one), or None
        (run it eagerly)."""
        if plan.num_prefill == 0 or len(rows) == 0:
            return None
        bucket = prefill_bucket(self.buckets, plan.num_tokens)
        n = plan.num_seqs
        return next(((s, bucket) for s in self.tiers if s >= n and (s, bucket) in self.graphs),
                    None)  # fmt: skip

    def can_run(self, plan, rows: np.ndarray) -> bool:
        return self.key(plan, rows) is not None

    def run(
        self, plan, rows: np.ndarray, ids: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A step `can_run` accepts -> (logits [len(rows), V], argmax [len(rows)]) of its
        sampling rows, views valid until the next run. ids: the input tokens of the plan's
        trailing decodes on the device (int32), instead of the plan's (a chained step)."""
        key = self.key(plan, rows)
        if self._copied is not None:
            self._copied.synchronize()  # a pipelined executor may not have waited for it
        self._fill(
            key, plan.input_ids, plan.positions, plan.slot_mapping, plan.context_lens,
            plan.query_start_loc, plan.block_tables, rows,
        )  # fmt: skip
        end = self._tables_at + (key[0] + 1) * self._width
        self.dev[:end].copy_(self.host[:end], non_blocking=True)
        self._copied = recorded_event(self.dev.device)
        if ids is not None:
            t = plan.num_tokens
            self.d[0][t - ids.shape[0] : t].copy_(ids)
        self.graphs[key].replay()
        logits, greedy = self.out[key]
        return logits[: len(rows)], greedy[: len(rows)]
