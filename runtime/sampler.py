"""Token sampling: greedy, or repetition penalty -> temperature -> top-k -> top-p -> draw.

Each request owns a seeded generator, so its tokens do not depend on what else is batched.
"""

from __future__ import annotations

import functools

import torch

from .types import SamplingParams


class RequestSampler:
    """Sampling state of one request."""

    def __init__(self, params: SamplingParams, device: torch.device) -> None:
        self.params = params
        self.generator: torch.Generator | None = None
        if params.temperature > 0 and not self.is_greedy:
            self.generator = torch.Generator(device=device)
            if params.seed is not None:
                self.generator.manual_seed(params.seed)
            else:
                self.generator.seed()

    @property
    def is_greedy(self) -> bool:
        p = self.params
        return p.temperature == 0 or p.top_k == 1

    def sample(self, logits: torch.Tensor, seen: torch.Tensor | None) -> int:
        """logits: [V] float32; seen: token ids so far (prompt + output) for the penalty."""
        p = self.params
        if p.repetition_penalty != 1.0 and seen is not None and seen.numel():
            logits = apply_repetition_penalty(logits, seen, p.repetition_penalty)
        if self.is_greedy:
            return int(torch.argmax(logits))
        logits = logits / p.temperature
        if p.top_k > 0:
            kth = torch.topk(logits, min(p.top_k, logits.numel())).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if p.top_p < 1.0:
            logits = top_p_filter(logits, p.top_p)
        probs = torch.softmax(logits, dim=-1)
        return int(torch.multinomial(probs, 1, generator=self.generator))


def apply_repetition_penalty(
    logits: torch.Tensor, seen: torch.Tensor, penalty: float
) -> torch.Tensor:
    """CTRL-style: a seen token's logit is divided by `penalty` if positive, multiplied if not."""
    logits = logits.clone()
    ids = seen.long().unique()
    picked = logits[ids]
    logits[ids] = torch.where(picked > 0, picked / penalty, picked * penalty)
    return logits


def top_p_filter(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose probability sums to >= top_p."""
    sorted_logits, order = torch.sort(logits, descending=True)
    cum = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
    # drop a token when the mass before it already reaches top_p (the top token always stays)
    drop = (cum - torch.softmax(sorted_logits, dim=-1)) >= top_p
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(0, order, sorted_logits)


@functools.cache  # NOTE: eager steps call greedy_tokens every step; the vocab never changes
def _argmax_chunks(vocab: int) -> int:
    """The largest divisor of `vocab` up to 256 (1: vocab is prime-ish or small)."""
    if vocab < 4096:
        return 1
    return max(c for c in range(1, 257) if vocab % c == 0)


@functools.cache
def aligned_argmax_chunks(vocab: int) -> int:
    """The largest divisor of `vocab` up to 256 whose chunks are whole 16-byte words of bf16
    (vocab // c a multiple of 8; 1 if none): Llama-3's 128,256 gives 167 chunks of 768, where
    _argmax_chunks gives 256 of 501, an odd row length that keeps the reduction from loading
    vectors (scripts/bench_step_kernels.py times both)."""
    return max((c for c in range(1, 257) if vocab % c == 0 and vocab // c % 8 == 0), default=1)


# Batches of at least this many rows take the aligned chunks when there are as many of them
# as rows need: as CUDA graphs on the H100, Llama-3's 167 chunks took 33.6 us at 128 rows and
# 98.6 at 512 against 40.1 and 123.4 for 256 chunks, but 14.0 against 13.4 at one row
# (step_kernels.json, 2026-12-06). Qwen2's vocabulary has only 16 aligned chunks: not timed,
# it keeps _argmax_chunks.
ALIGNED_ARGMAX_ROWS = 128


def default_argmax_chunks(rows: int, vocab: int) -> int:
    """greedy_tokens' chunks for a [rows, vocab] batch of logits."""
    aligned = aligned_argmax_chunks(vocab)
    if rows >= ALIGNED_ARGMAX_ROWS and aligned >= ALIGNED_ARGMAX_ROWS:
        return aligned
    return _argmax_chunks(vocab)


def greedy_tokens(logits: torch.Tensor, chunks: int | None = None) -> torch.Tensor:
    """argmax over the last dim of [B, V] logits, same result (first index of the maximum).

    In two stages, because one row's argmax is a single-block reduction: on the H200 it took
    28 us of a 4.4 ms batch-1 decode step for a 128k vocabulary. The row splits into chunks
    (max and its index per chunk, in parallel), then the first chunk holding the maximum wins.
    chunks: how many (a divisor of V; default default_argmax_chunks).
    """
    b, v = logits.shape
    c = default_argmax_chunks(b, v) if chunks is None else chunks
    if c == 1:
        return logits.argmax(dim=-1)
    vals, idx = logits.reshape(b, c, v // c).max(dim=-1)  # [B, c] each
    best = vals.argmax(dim=-1, keepdim=True)  # ties: the first chunk, as argmax would
    return (best * (v // c) + idx.gather(-1, best)).squeeze(-1)
