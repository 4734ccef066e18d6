"""Decode steps replayed from CUDA graphs captured per batch-size bucket.

A decode-only step of B sequences runs the graph of the smallest bucket >= B. Rows past B are
padding: they write their KV into the cache's scratch block and attend to one scratch token, so
they never touch a real sequence. Python is off the per-token path except for copying the
step's inputs into the static buffers.
"""

from __future__ import annotations

import numpy as np
import torch

from .kv_cache import KVCache
from .model import AttnMetadata, Decoder


def batch_buckets(max_batch_size: int) -> list[int]:
    """1, 2, 4, 8, then steps of 8 up to 64, then powers of two, always ending at the maximum."""
    sizes = [b for b in (1, 2, 4) if b < max_batch_size]
    b = 8
    while b < max_batch_size:
        sizes.append(b)
        b = b + 8 if b < 64 else b * 2
    return sizes + [max_batch_size]


class DecodeGraphs:
    """Captured decoder.forward + logits for decode-only steps."""

    def __init__(
        self,
        decoder: Decoder,
        kv: KVCache,
        max_batch_size: int,
        max_blocks_per_seq: int,
        max_context_len: int,
        device: torch.device,
    ) -> None:
        self.decoder, self.kv = decoder, kv
        self.buckets = batch_buckets(max_batch_size)
        n = max_batch_size
        i32 = dict(dtype=torch.int32, device=device)
        self.ids = torch.zeros(n, **i32)
        self.pos = torch.zeros(n, **i32)
        self.slots = torch.zeros(n, **i32)
        self.tables = torch.zeros(n, max_blocks_per_seq, **i32)
        self.ctx = torch.ones(n, **i32)
        self.qsl = torch.arange(n + 1, **i32)
        self.max_context_len = max_context_len
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self._capture_all()

    def _meta(self, b: int) -> AttnMetadata:
        return AttnMetadata(
            self.slots[:b],
            self.tables[:b],
            self.ctx[:b],
            self.qsl[: b + 1],
            self.max_context_len,
            1,
        )

    def _run(self, b: int) -> torch.Tensor:
        hidden = self.decoder.forward(self.ids[:b], self.pos[:b], self._meta(b), self.kv)
        return self.decoder.logits(hidden)

    def _pad_all(self) -> None:
        scratch = self.kv.scratch_block
        self.slots.fill_(scratch * self.kv.tokens_per_block)
        self.tables.fill_(scratch)
        self.ctx.fill_(1)
        self.pos.zero_()
        self.ids.zero_()

    def _capture_all(self) -> None:
        self._pad_all()
        pool = None
        for b in reversed(self.buckets):  # largest first, so smaller graphs reuse its pool
            # NOTE: warm-up outside capture: kernels load (and autotune caches fill) here.
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                self._run(b)
            torch.cuda.current_stream().wait_stream(s)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=pool):
                self.logits[b] = self._run(b)
            pool = g.pool()
            self.graphs[b] = g
        torch.cuda.synchronize()

    def can_run(self, num_seqs: int) -> bool:
        return num_seqs <= self.buckets[-1]

    def run(self, plan) -> torch.Tensor:
        """plan: a decode-only StepPlan of B sequences -> float32 logits [B, V] (a view)."""
        b = plan.num_seqs
        bucket = next(x for x in self.buckets if x >= b)
        self._pad_all()
        width = plan.block_tables.shape[1]
        self.ids[:b].copy_(torch.from_numpy(np.asarray(plan.input_ids)), non_blocking=True)
        self.pos[:b].copy_(torch.from_numpy(np.asarray(plan.positions)), non_blocking=True)
        self.slots[:b].copy_(torch.from_numpy(np.asarray(plan.slot_mapping)), non_blocking=True)
        self.ctx[:b].copy_(torch.from_numpy(np.asarray(plan.context_lens)), non_blocking=True)
        self.tables[:b, :width].copy_(
            torch.from_numpy(np.asarray(plan.block_tables)), non_blocking=True
        )
        self.graphs[bucket].replay()
        return self.logits[bucket][:b]
